"""Choosing k per step from measurements: `num_speculative_tokens="auto"`.

The closed form (seed §12.5, Leviathan et al. theorem 3.8): with each draft accepted with
probability alpha given that the ones before it were, a step with k drafts yields
(1 - alpha^(k+1)) / (1 - alpha) tokens on average and costs (1 + c k) plain decode steps, so

    speedup(alpha, c, k) = (1 - alpha^(k+1)) / ((1 - alpha) (1 + c k))

`choose_k` takes the k in 1..k_max that maximizes it, or 0 (no drafts: a plain decode step)
when no k predicts a speedup above 1. `choose_k_for_costs` does the same with a measured cost per
k in place of 1 + c k.

`AutoKController` estimates alpha and c while generate() runs. What it learned carries over to the
next generate() call on the same model with the same speculative config and sampling mode
(`controller_for`): a call of a few dozen tokens is over in about ten steps, too few to learn from
the priors again each time (the Qwen2.5-Coder pair at 64 tokens: auto k reached 93% of the best
fixed k when it started from the priors in every call). `forget(model)` starts it afresh.

- alpha: each drafted step of a row tests its drafts in order until the first rejection, so it
  is a run of Bernoulli(alpha) trials: accepted / (accepted + rejections) over every row and
  step. (accepted / drafted, vLLM's "acceptance rate", is smaller: it counts the untested drafts
  after a rejection as failures.) Both sums start from a prior and decay exponentially per step,
  so the estimate follows a text whose predictability changes.
- c: the seed defines c as draft time / verify time and assumes verifying k + 1 tokens costs as
  much as decoding 1. On a CPU, or a GPU at a large batch, it does not: the verify forward grows
  with the tokens it carries. So we fold both into one measured number, the extra cost per
  draft token of a speculative step over a plain (drafts-free) step at the same batch size:

      c = (t_step / t_plain_step - 1) / k_drafted

  where t_step is the whole step (draft + verify + sampling) and k_drafted the step's draft
  tokens per row. With this c the formula's denominator is exactly the measured step cost. The
  verify cost per token grows with the batch (on a CPU, a batch of 8 verifying 2 tokens each is
  compute-bound, one row is not), so c is kept per number of active rows, as rows finish and
  the batch shrinks. A size not measured yet starts from the prior: an optimistic c that makes
  it draft, and so measure its own cost, rather than inherit a larger batch's "drafts do not
  pay". Where c makes every k predict a loss, speculation turns itself off at that batch size:
  `disable_by_batch_size` from measurements.
- cost per k: 1 + c k is a straight line, and a CPU's step cost is not: on the Intel Xeon a
  SmolLM2 forward of 1 / 2 / 3 / 4 tokens takes 44 / 48 / 51 / 74 ms (torch's BLAS up to 3 rows,
  another route above), and at batch 8 the verify crosses the fast kernel's row limit between
  k=1 and k=2. One c fitted to the steps taken mispredicts the ks not taken, in both directions.
  So each (active rows, k) also keeps the measured time of its own steps, and its cost is that over
  the plain step's time, divided when k is chosen: it starts from the line's price (weighing as one
  step), and each later step at that k counts more than the ones before (the same decay). k is
  chosen on those costs. A k never run is priced by the line, so a k that looks cheap there gets
  tried and from then on priced by what it cost. Dividing when k is chosen, not when a step is
  recorded, keeps one plain step's noise out of the comparison between ks: a CPU VM's steps vary by
  10-20%, plain steps come one in `probe_interval`, and a k priced on a plain step that ran fast
  looked dear until it ran again, which, looking dear, it did not.
- t_plain_step: the loop's own steps that drafted nothing (no n-gram match, or k = 0), kept per
  number of active rows (rows leave the batch as they finish). When none is recent, the step
  is forced to k = 0: a probe costing one step's worth of drafts. A batch size not measured yet
  borrows the plain time of the nearest measured size within `PLAIN_BORROW_RANGE` (a row leaving
  a batch of 8 changes a CPU's plain step by a few percent; a probe at 64 tokens and tau 8 costs
  a tenth of the call), and gets its own at the next periodic probe.
- Untimed steps: the first step of a call (or the one a request joins in) runs the prompts, and
  the next one is where a drafter catches up on them (an EAGLE head's forward over every prompt
  position: SmolLM2's head at batch 8 took 450 ms there against 100 ms for a decode step, which
  priced k = 2 at 3.4 plain steps and turned drafting off for the rest of the run). Neither says
  what a decode step costs: their times are not used (their acceptance is). Nor is the time of the
  first step that drafts after a step that did not: an EAGLE head leaves the features of steps
  without drafts waiting and feeds them all in that step. Timed, it priced the k it ran at what the
  steps before it had put off, the dearer the longer auto k had stayed off; a k so priced was not
  chosen again, so not measured again: on an AMD EPYC Zen 4, SmolLM2's EAGLE-3 head at batch 1 had
  k = 1 priced at 1.47 plain steps against the 1.06 its steps cost, drafted nothing in 42% of its
  steps and reached 87-90% of fixed k = 1.
- Acceptance by depth: k is chosen on `DepthAcceptance`, each draft depth's own chance of being accepted
  given the drafts before it were, not on one alpha for every depth. A head's later drafts are worse
  guesses (SmolLM2's EAGLE-3 head on MT-bench answers: 0.51, 0.47, 0.37, 0.27 at depths 1-4), so the
  pooled alpha, learned mostly at depths 1-2, priced k = 3-4 too high; an n-gram match's later drafts are
  better ones (SmolLM2 on HumanEval, k = 8: 0.62, 0.80, 0.78, 0.91 at depths 1-4). Each depth keeps about its last 20 trials (`DEPTH_DECAY` per trial at that depth: a depth
  tried rarely keeps what its last trials said) and leans toward the depth above it (`DEPTH_PRIOR_WEIGHT`
  trials; depth 1 toward the pooled alpha), so a depth not tried yet reads as the one above. The pooled
  alpha still decides whether to speculate at all (below), and a batch's last row (below) is priced on its
  own alpha.
- A step's time counts at most `STEP_TIME_CLIP` times its price so far once that price was measured (a
  plain step: its plain time): a CPU VM stalls now and then, and a step that took twice its price made its k
  look dear for the next ten steps, so auto k left the best k. Replayed on the EAGLE-3 head's greedy
  acceptance with step prices from a run (`benchmarks/auto_k_replay.py`, 5% of the steps stalled to 2x),
  depth and clip together took auto k from 96.6% to 98.3% of the best fixed k along 80 MT-bench answers,
  from 95.1% to 97.5% along 40 HumanEval ones.
- Off only when even an optimistic alpha (`optimistic_alpha`: one standard error above the
  estimate, the decayed trial count as the sample size) predicts no k above 1; k itself is chosen
  on the estimate. A few early rejections (EAGLE-3 on SmolLM2 at batch 1: its first four drafts
  rejected, alpha 0.18 against a true 0.43) had switched it off, and one exploratory draft per
  `probe_interval` steps brought it back only after hundreds of steps (auto k at 90% of the best
  fixed k on that run).
- While speculation is off, every `probe_interval` steps one step drafts anyway, at the k the
  formula ranks best, so a text that became predictable turns it back on. While it is on, halfway
  between plain probes, a step runs at k - 1 or k + 1 where that was not timed for `probe_interval`
  steps: each k's price is its own steps', and a k that ran slow once (a CPU VM's steps vary by
  10-20%) would otherwise never be timed again. On the Zen 4 run above, with the catch-up untimed,
  k = 1 was still priced at 1.3-1.5 plain steps from its first few steps, and k = 2 ran 86% of them.
- A fixed batch (generate()'s, not the engine's) ends when its last row does, so what a step is worth
  there is the progress of the row furthest from its end (`next_k(last_row=...)`): the others'
  extra tokens only finish them sooner. k is chosen on that row's own alpha, where a step in which it
  drafted nothing (no n-gram match) counts as a rejection: that is the token it gets. On SmolLM2's
  n-gram runs at batch 8 (AMD EPYC Zen 2) a call took 186-195 steps whether k was 2, 4, 8 or auto, so
  the pooled alpha's mean k of 5.4 bought only dearer steps: 0.99x against k = 2's 1.06x. Each row's
  estimate starts from the pooled alpha (so a short call is not back at the prior) and is this call's.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, fields

TIE_TOLERANCE = 1e-9  # relative
# steps after a call starts (or a request joins) whose time is not a decode step's: the prompts'
# step, then the drafters' catch-up on them (module docstring)
UNTIMED_STEPS = 2
# a batch size without its own plain step time borrows the nearest measured size's when it is
# within this fraction of it (module docstring)
PLAIN_BORROW_RANGE = 0.25
# weight kept by earlier plain step times per plain step (one comes every `probe_interval` steps or so)
PLAIN_DECAY = 0.7
# `DepthAcceptance`: weight kept by a depth's earlier trials per trial there; the weight, in trials, of its
# lean toward the depth above
DEPTH_DECAY = 0.95
DEPTH_PRIOR_WEIGHT = 4.0
# a timed step counts at most this many times its measured price (module docstring)
STEP_TIME_CLIP = 1.3


def predicted_speedup(alpha: float, c: float, k: int) -> float:
    """Tokens per unit of plain-decode time with k drafts, relative to plain decoding (seed §12.5)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} is out of range; allowed: 0 <= alpha <= 1")
    if c < 0:
        raise ValueError(f"c={c!r} is out of range; allowed: c >= 0")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k={k!r} is invalid; allowed: an integer >= 0")
    return expected_tokens(alpha, k) / (1 + c * k)


def expected_tokens(alpha: float, k: int) -> float:
    """1 + alpha + ... + alpha^k: tokens a step with k drafts yields on average."""
    return (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 - 1e-9 else k + 1.0


def best_k_for_costs(alpha: float, step_costs: Sequence[float]) -> int:
    """The k in 1..len(step_costs) with the most tokens per unit of cost (`step_costs[k - 1]`: a
    step with k drafts, in plain steps), each draft accepted with probability alpha given the ones
    before it were: `best_k_for_tokens`."""
    return best_k_for_tokens([expected_tokens(alpha, k) for k in range(1, len(step_costs) + 1)], step_costs)


def best_k_for_tokens(tokens: Sequence[float], step_costs: Sequence[float]) -> int:
    """The k in 1..len(step_costs) with the most tokens per unit of cost (`tokens[k - 1]`: a step with k
    drafts yields that many on average, at `step_costs[k - 1]` plain steps): the smallest k within
    `TIE_TOLERANCE` of the best (with free drafts the ratio creeps up by float rounding only: more
    drafts, no gain)."""
    if not step_costs or any(cost <= 0 for cost in step_costs):
        raise ValueError(f"step_costs={list(step_costs)!r} is invalid; allowed: one cost > 0 per k = 1, 2, ...")
    if len(tokens) != len(step_costs):
        raise ValueError(f"tokens has {len(tokens)} entries and step_costs {len(step_costs)}; allowed: one each per k")
    speedups = [n / cost for n, cost in zip(tokens, step_costs)]
    best = max(speedups)
    return next(k for k, s in enumerate(speedups, start=1) if s >= best * (1 - TIE_TOLERANCE))


def choose_k_for_costs(alpha: float, step_costs: Sequence[float]) -> int:
    """`best_k_for_costs`, or 0 (decode without drafts) when no k predicts a speedup above 1."""
    k = best_k_for_costs(alpha, step_costs)
    return k if expected_tokens(alpha, k) / step_costs[k - 1] > 1.0 else 0


def _line_costs(c: float, k_max: int) -> list[float]:
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max={k_max!r} is invalid; allowed: an integer >= 1")
    return [1 + c * k for k in range(1, k_max + 1)]


def best_k(alpha: float, c: float, k_max: int) -> int:
    """The k in 1..k_max with the highest predicted speedup (`best_k_for_costs` on 1 + c k)."""
    return best_k_for_costs(alpha, _line_costs(c, k_max))


def choose_k(alpha: float, c: float, k_max: int) -> int:
    """`best_k`, or 0 (decode without drafts) when no k in 1..k_max predicts a speedup above 1."""
    return choose_k_for_costs(alpha, _line_costs(c, k_max))


@dataclass
class DecayedRatio:
    """sum(numerators) / sum(denominators), every earlier term multiplied by `decay` per update."""

    numerator: float
    denominator: float
    decay: float

    def update(self, numerator: float, denominator: float) -> None:
        self.numerator = self.decay * self.numerator + numerator
        self.denominator = self.decay * self.denominator + denominator

    @property
    def value(self) -> float:
        return self.numerator / self.denominator


class DepthAcceptance:
    """Acceptance by draft depth (module docstring): depth j's chance that draft j is accepted given
    drafts 1..j-1 were, from the trials at that depth, each depth leaning toward the one above it."""

    def __init__(self, max_depth: int, decay: float = DEPTH_DECAY, prior_weight: float = DEPTH_PRIOR_WEIGHT):
        self._depths = [DecayedRatio(0.0, 0.0, decay) for _ in range(max_depth)]
        self._prior_weight = prior_weight

    def record(self, drafted: int, accepted: int) -> None:
        """One row's step of `drafted` (<= max_depth) chain drafts: 1..accepted passed, the next (if drafted) failed."""
        for ratio in self._depths[:accepted]:
            ratio.update(1.0, 1.0)
        if accepted < drafted:
            self._depths[accepted].update(0.0, 1.0)

    def rates(self, first_prior: float) -> list[float]:
        """Each depth's acceptance, depth 1 leaning toward `first_prior`."""
        rates, prior = [], first_prior
        for depth in self._depths:
            prior = (depth.numerator + self._prior_weight * prior) / (depth.denominator + self._prior_weight)
            rates.append(prior)
        return rates

    def expected_tokens(self, first_prior: float) -> list[float]:
        """Tokens a step with k = 1, 2, ... drafts yields on average: 1 + a_1 + a_1 a_2 + ... (k terms)."""
        tokens, reached, total = [], 1.0, 1.0
        for rate in self.rates(first_prior):
            reached *= rate
            total += reached
            tokens.append(total)
        return tokens


@dataclass
class PlainStepTime:
    seconds: DecayedRatio  # seconds per plain step
    last_step: int  # the controller step that measured it last


class AutoKController:
    """Per-step k from running estimates of alpha and c (see the module docstring).

    The loop asks `next_k(num_rows)` before drafting and reports the step with `record_step`.

    Args:
        k_max: the largest k to choose (`max_speculative_tokens`).
        alpha_prior, c_prior: the estimates before any step; each weighs as `prior_weight` samples
            (draft trials for alpha, draft tokens per row for c) and decays like the data.
        decay: weight kept by earlier data per step (0.9: about the last ten steps count).
        probe_interval: steps between forced plain steps (k = 0) while speculating, and between
            exploratory drafting steps while not.
    """

    def __init__(
        self,
        k_max: int,
        alpha_prior: float = 0.5,
        c_prior: float = 0.1,
        prior_weight: float = 4.0,
        decay: float = 0.9,
        probe_interval: int = 32,
    ):
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"k_max={k_max!r} is invalid; allowed: an integer >= 1")
        if probe_interval < 2:
            raise ValueError(f"probe_interval={probe_interval!r} is invalid; allowed: an integer >= 2")
        self.k_max = k_max
        self.probe_interval = probe_interval
        self._alpha = DecayedRatio(alpha_prior * prior_weight, prior_weight, decay)
        self._depth_acceptance = DepthAcceptance(k_max)
        self._c_prior, self._prior_weight, self._decay = c_prior, prior_weight, decay
        self._c: dict[int, DecayedRatio] = {}  # by number of active rows
        self._step_seconds: dict[tuple[int, int], DecayedRatio] = {}  # by (active rows, k): seconds per step
        self._timed_at: dict[tuple[int, int], int] = {}  # by (active rows, k): the step that last timed one
        self._plain: dict[int, PlainStepTime] = {}  # by number of active rows
        self._row_alpha: dict[int, DecayedRatio] = {}  # this batch's rows, a step without drafts a rejection
        self._steps = 0  # steps recorded so far
        self._last_drafted_step = 0
        self._untimed_steps = UNTIMED_STEPS  # steps left whose time says nothing about decoding
        self._drafted_last_step = True  # False: the next step that drafts feeds what this one put off (untimed)

    def begin_batch(self) -> None:
        """A generate() call (or an engine) starts: `begin_call`, and its rows' own alphas start afresh."""
        self._row_alpha.clear()
        self.begin_call()

    def begin_call(self) -> None:
        """A generate() call starts, or a step feeds prompts (`step.speculative_step`: a request joined,
        or a prompt chunk): the next `UNTIMED_STEPS` steps, that one included, are not timed."""
        self._untimed_steps = UNTIMED_STEPS

    @property
    def alpha(self) -> float:
        """Estimated probability that a draft is accepted, given the drafts before it were."""
        return self._alpha.value

    def c(self, num_rows: int) -> float:
        """Estimated extra cost per draft token at `num_rows` active rows, in plain steps (>= 0)."""
        return max(self._c_estimate(num_rows).value, 0.0)

    def _c_estimate(self, num_rows: int) -> DecayedRatio:
        estimate = self._c.get(num_rows)
        if estimate is None:
            estimate = self._c[num_rows] = DecayedRatio(
                self._c_prior * self._prior_weight, self._prior_weight, self._decay
            )
        return estimate

    def step_cost(self, num_rows: int, k: int) -> float:
        """Estimated cost of a step with k drafts at `num_rows` active rows, in plain steps: its steps' time
        over the plain step's, where steps with that k ran, else the line 1 + c k."""
        measured, plain = self._step_seconds.get((num_rows, k)), self._plain_time(num_rows)
        if measured is None or plain is None:
            return 1 + self.c(num_rows) * k
        return measured.value / plain.seconds.value

    def _plain_time(self, num_rows: int) -> PlainStepTime | None:
        """The plain step time at `num_rows` rows: measured there, or borrowed from the nearest
        measured size within `PLAIN_BORROW_RANGE` (the larger one on a tie), or None."""
        own = self._plain.get(num_rows)
        if own is not None:
            return own
        near = [rows for rows in self._plain if abs(rows - num_rows) <= PLAIN_BORROW_RANGE * rows]
        return self._plain[min(near, key=lambda rows: (abs(rows - num_rows), -rows))] if near else None

    @property
    def optimistic_alpha(self) -> float:
        """alpha one standard error above its estimate (the decayed trial count as the sample size):
        what speculation is switched off on (module docstring)."""
        return _optimistic(self._alpha)

    def next_k(self, num_rows: int, last_row: int | None = None) -> int:
        """k for the next step of `num_rows` active rows: the formula's choice, or a probe. `last_row`: in a
        batch that ends with its last row, the row furthest from its end, whose alpha then decides."""
        estimate = self._row_alpha.get(last_row) if last_row is not None and num_rows > 1 else None
        if estimate is None:
            tokens, optimistic = self._depth_acceptance.expected_tokens(self.alpha), self.optimistic_alpha
        else:
            tokens, optimistic = [expected_tokens(estimate.value, k) for k in range(1, self.k_max + 1)], _optimistic(estimate)
        costs = [self.step_cost(num_rows, k) for k in range(1, self.k_max + 1)]
        k = best_k_for_tokens(tokens, costs) if choose_k_for_costs(optimistic, costs) else 0
        if self._untimed_steps:  # no decode timing to take: speculate on the estimates
            return k
        plain = self._plain_time(num_rows)
        if plain is None or self._steps - plain.last_step >= self.probe_interval:
            return 0
        if k == 0 and self._steps - self._last_drafted_step >= self.probe_interval:
            return best_k_for_tokens(tokens, costs)
        if k and self._steps % self.probe_interval == self.probe_interval // 2:  # halfway between plain probes
            return self._neighbour_to_time(num_rows, k)
        return k

    def _neighbour_to_time(self, num_rows: int, k: int) -> int:
        """k - 1 or k + 1, whichever was timed longer ago, where that is `probe_interval` steps or more (else k):
        a k priced on a few slow steps is not chosen, so not timed again, unless it is tried now and then."""
        neighbours = [n for n in (k - 1, k + 1) if 1 <= n <= self.k_max]
        oldest = min(neighbours, key=lambda n: self._timed_at.get((num_rows, n), -self.probe_interval), default=k)
        return oldest if self._steps - self._timed_at.get((num_rows, oldest), -self.probe_interval) >= self.probe_interval else k

    def record_step(
        self, seconds: float, k: int, num_draft_tokens: Sequence[int], num_accepted: Sequence[int],
        rows: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        """One finished step: its wall time, the k it ran with (the limit per row) and, per active
        row, drafts proposed and accepted; `rows`: the active rows, for their own alphas."""
        self._steps += 1
        if rows is not None and k > 0:
            for row, drafted, row_accepted in zip(rows, num_draft_tokens, num_accepted):
                estimate = self._row_alpha.get(row)
                if estimate is None:  # from the pooled estimate, weighing as its prior does
                    estimate = self._row_alpha[row] = DecayedRatio(self.alpha * self._prior_weight, self._prior_weight, self._decay)
                estimate.update(row_accepted, row_accepted + (row_accepted < drafted or drafted == 0))
        for drafted, row_accepted in zip(num_draft_tokens, num_accepted):  # chains: auto k takes no trees
            if drafted:
                self._depth_acceptance.record(drafted, row_accepted)
        accepted = sum(num_accepted)
        rejections = sum(1 for d, a in zip(num_draft_tokens, num_accepted) if a < d)
        if accepted + rejections:
            self._alpha.update(accepted, accepted + rejections)
        drafted_per_row = sum(num_draft_tokens) / len(num_draft_tokens)
        if drafted_per_row > 0:
            self._last_drafted_step = self._steps
        catching_up, self._drafted_last_step = drafted_per_row > 0 and not self._drafted_last_step, drafted_per_row > 0
        if self._untimed_steps:
            self._untimed_steps -= 1
            return
        if catching_up:  # its time holds what the steps without drafts put off (module docstring)
            return
        num_rows = len(num_draft_tokens)
        plain = self._plain.get(num_rows)
        if drafted_per_row == 0:
            if plain is None:
                self._plain[num_rows] = PlainStepTime(DecayedRatio(seconds, 1.0, PLAIN_DECAY), self._steps)
            else:  # recent plain steps weigh more (`PLAIN_DECAY`): the context, and with it the step time, grows
                plain.seconds.update(min(seconds, STEP_TIME_CLIP * plain.seconds.value), 1.0)
                plain.last_step = self._steps
        elif (plain := self._plain_time(num_rows)) is not None:
            key = (num_rows, k)
            if key not in self._step_seconds:  # starts from the line's price, weighing as one step
                self._step_seconds[key] = DecayedRatio(self.step_cost(*key) * plain.seconds.value, 1.0, self._decay)
            else:  # a measured price: a stall counts as `STEP_TIME_CLIP` of it
                seconds = min(seconds, STEP_TIME_CLIP * self._step_seconds[key].value)
            cost = seconds / plain.seconds.value
            self._step_seconds[key].update(seconds, 1.0)
            self._timed_at[key] = self._steps
            # weighted by k_drafted: a step that drafted little says little about the cost per draft
            self._c_estimate(num_rows).update(cost - 1.0, drafted_per_row)


def _optimistic(alpha: DecayedRatio) -> float:
    """alpha one standard error above its estimate, the decayed trial count as the sample size."""
    value, trials = alpha.value, alpha.denominator
    return min(1.0, value + (value * (1 - value) / trials) ** 0.5)


# per model: (speculative config, sampling mode) -> its controller, the most recent MAX_CONTROLLERS
_CONTROLLERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MAX_CONTROLLERS = 8


def controller_for(model, config, do_sample: bool) -> AutoKController:
    """The `AutoKController` of `model` for `config` (a `SpeculativeConfig` with auto k) and the
    sampling mode, created on first use and kept between generate() calls (see the module docstring)."""
    key = (
        tuple((f.name, _identity(getattr(config, f.name))) for f in fields(config) if f.name != "seed"),
        bool(do_sample),
    )
    kept = _CONTROLLERS.setdefault(model, {})
    controller = kept.pop(key, None) or AutoKController(config.max_draft_tokens)
    kept[key] = controller  # the most recently used last
    while len(kept) > MAX_CONTROLLERS:
        kept.pop(next(iter(kept)))
    controller.begin_batch()
    return controller


def forget(model) -> None:
    """Drop what auto k learned on `model`: its next generate() calls start from the priors."""
    _CONTROLLERS.pop(model, None)


def _identity(value):
    """A config value as part of a key: objects that are not plain values (a loaded draft) by identity."""
    return value if value is None or isinstance(value, (str, int, float, bool, tuple)) else ("id", id(value))
