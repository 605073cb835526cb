"""num_speculative_tokens="auto": the closed-form speedup, the choice of k, the running estimator
and the loop using it (greedy output unchanged, every drafter held to the per-step k)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import build_tiny_llama, ngram_config, plain_generate, repeated_span_batch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.loop import auto_k, engine
from hf_specdec.loop.auto_k import (
    AutoKController,
    DepthAcceptance,
    best_k,
    best_k_for_costs,
    choose_k,
    choose_k_for_costs,
    predicted_speedup,
)
from hf_specdec.loop.metrics import SpecDecodeMetrics

# --- the formula ----------------------------------------------------------------------------------

# seed §12.5.4: (alpha, c) -> speedup at k = 3, 5, 7
SEED_TABLE = [
    (0.75, 0.05, (2.38, 2.63, 2.67)),
    (0.55, 0.20, (1.26, 1.08, 0.92)),
    (0.25, 0.00, (1.33, 1.33, 1.33)),
    (0.75, 0.40, (1.24, 1.10, 0.95)),
]


@pytest.mark.parametrize("alpha,c,expected", SEED_TABLE)
def test_predicted_speedup_reproduces_the_seed_table(alpha, c, expected):
    for k, value in zip((3, 5, 7), expected):
        assert predicted_speedup(alpha, c, k) == pytest.approx(value, abs=0.006)


def test_predicted_speedup_edge_cases():
    assert predicted_speedup(0.6, 0.3, 0) == 1.0  # no drafts: plain decoding
    assert predicted_speedup(0.0, 0.2, 4) == pytest.approx(1 / 1.8)  # every draft rejected: pure cost
    # alpha -> 1: (k + 1) / (1 + c k), continuous from below
    assert predicted_speedup(1.0, 0.1, 4) == pytest.approx(5 / 1.4)
    assert predicted_speedup(1.0 - 1e-7, 0.1, 4) == pytest.approx(5 / 1.4, rel=1e-5)
    assert predicted_speedup(1.0, 0.0, 31) == 32.0
    for bad in ({"alpha": 1.2}, {"alpha": -0.1}, {"c": -0.5}, {"k": -1}, {"k": 2.5}):
        arguments = {"alpha": 0.5, "c": 0.1, "k": 3, **bad}
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            predicted_speedup(**arguments)


def _speedups_by_hand(alpha: float, c: float, k_max: int) -> list[float]:
    """sum_{i<=k} alpha^i / (1 + c k): the expected tokens per step written as the plain sum."""
    return [sum(alpha**i for i in range(k + 1)) / (1 + c * k) for k in range(1, k_max + 1)]


@pytest.mark.parametrize("alpha", [0.2, 0.4, 0.55, 0.7, 0.8, 0.9, 0.97])
@pytest.mark.parametrize("c", [0.0, 0.02, 0.05, 0.1, 0.2, 0.4])
@pytest.mark.parametrize("k_max", [1, 4, 8, 32])
def test_choose_k_is_the_formulas_argmax(alpha, c, k_max):
    speedups = _speedups_by_hand(alpha, c, k_max)
    best = max(speedups)
    # the smallest k at the maximum, float plateaus (c = 0, alpha^k below rounding) counted as ties
    expected = next(k for k, s in enumerate(speedups, start=1) if s >= best * (1 - 1e-9))
    assert best_k(alpha, c, k_max) == expected
    assert choose_k(alpha, c, k_max) == (expected if best > 1 else 0)


def test_choose_k_known_values():
    assert choose_k(0.75, 0.05, 8) == 7  # the seed's first row: 2.666 at k = 6, 2.667 at 7, less at 8
    assert choose_k(0.55, 0.20, 8) == 2  # "the best k is small"
    assert choose_k(0.95, 0.0, 8) == 8  # free drafts: as many as allowed
    assert choose_k(0.1, 0.5, 8) == 0  # every k loses: decode plainly
    assert all(predicted_speedup(0.1, 0.5, k) < 1 for k in range(1, 9))
    assert choose_k(0.5, 1.0, 32) == 0


# --- the running estimator ------------------------------------------------------------------------


def simulate(
    controller: AutoKController, alpha: float, c_of_rows, rows_of_step, steps: int, seed: int = 0, cost_of=None,
    alphas: list | None = None,
):
    """Drive the controller with synthetic steps: every row drafts the k asked, accepts a geometric
    run of them, and the step takes t_plain (1 + c k) seconds (or t_plain cost_of(rows, k)) with 2 %
    noise. Returns the ks chosen; `alphas` receives the alpha estimate after each step."""
    rng = random.Random(seed)
    chosen = []
    for step in range(steps):
        rows = rows_of_step(step)
        k = controller.next_k(rows)
        chosen.append(k)
        accepted = []
        for _ in range(rows):
            n = 0
            while n < k and rng.random() < alpha:
                n += 1
            accepted.append(n)
        # the first step also runs the prompts
        t_plain = 0.01 * (1 + 0.3 * rows) * (3.0 if step == 0 else 1.0)
        cost = 1 + c_of_rows(rows) * k if cost_of is None else cost_of(rows, k)
        seconds = t_plain * cost * (1 + 0.02 * (rng.random() - 0.5))
        controller.record_step(seconds, k, [k] * rows, accepted)
        if alphas is not None:
            alphas.append(controller.alpha)
    return chosen


@pytest.mark.parametrize("alpha,c", [(0.8, 0.05), (0.6, 0.1), (0.9, 0.02), (0.5, 0.25)])
def test_controller_converges_to_the_formulas_k(alpha, c):
    controller = AutoKController(k_max=8, probe_interval=32)
    alphas = []
    chosen = simulate(controller, alpha, lambda rows: c, lambda step: 4, steps=400, alphas=alphas)
    # the estimate's window is about ten steps (a few dozen trials at k = 1): its mean over the late steps
    assert sum(alphas[200:]) / 200 == pytest.approx(alpha, abs=0.05)
    assert controller.c(4) == pytest.approx(c, abs=0.02)
    expected = choose_k(alpha, c, 8)
    assert expected > 0
    late = chosen[200:]
    # past the start, steps use the formula's k except the plain probes (one per probe_interval)
    assert sum(k == 0 for k in late) <= len(late) // 32 + 1
    decided = [k for k in late if k > 0]
    assert abs(max(set(decided), key=decided.count) - expected) <= 1
    assert abs(choose_k(controller.alpha, controller.c(4), 8) - expected) <= 1


def test_controller_probes_plain_steps_per_batch_size():
    controller = AutoKController(k_max=8, probe_interval=16)
    chosen = simulate(controller, 0.8, lambda rows: 0.05, lambda step: 4 if step < 40 else 3, steps=80)
    # the prompts' step and the drafter's catch-up step speculate on the priors (their times are not used)
    assert chosen[0] > 0 and chosen[1] > 0
    assert chosen[2] == 0  # then a plain step gives the reference time
    # and probes recur every probe_interval steps (step 2's plain time was recorded as step 3)
    assert chosen[19] == 0 and all(k > 0 for k in chosen[3:19])
    # a row finished: 3 rows borrow 4 rows' plain time (within PLAIN_BORROW_RANGE) instead of probing
    # at once, and measure their own at the next periodic probe
    assert chosen[40] > 0
    first_probe_at_3 = 40 + chosen[40:].index(0)
    assert first_probe_at_3 <= 40 + 16 and 3 in controller._plain


def test_controller_borrows_plain_time_only_from_a_near_batch_size():
    controller = AutoKController(k_max=8, probe_interval=16)
    simulate(controller, 0.8, lambda rows: 0.05, lambda step: 8, steps=10)
    assert controller._plain_time(7) is controller._plain[8] and controller._plain_time(6) is controller._plain[8]
    assert controller._plain_time(5) is None and controller.next_k(5) == 0  # too far: probe its own
    assert controller.next_k(7) > 0


def test_controller_turns_speculation_off_when_drafts_cost_too_much():
    # cheap at batch 1, expensive at batch 8 (the verify forward grows with the batch)
    controller = AutoKController(k_max=8, probe_interval=32)
    chosen = simulate(controller, 0.6, lambda rows: 0.02 if rows == 1 else 1.0, lambda step: 8, steps=300)
    assert controller.c(8) > 0.5
    assert choose_k(controller.alpha, controller.c(8), 8) == 0
    late = chosen[100:]
    assert sum(k > 0 for k in late) <= len(late) // 32 + 1  # only the exploratory steps draft
    assert any(k > 0 for k in late), "speculation must be retried now and then"

    cheap = AutoKController(k_max=8, probe_interval=32)
    chosen = simulate(cheap, 0.6, lambda rows: 0.02 if rows == 1 else 1.0, lambda step: 1, steps=300)
    assert sum(k > 0 for k in chosen[100:]) > 0.9 * 200


def test_early_rejections_do_not_switch_speculation_off():
    """Bad luck at the start (a true alpha of 0.43, drafts cheap, the first four rejected: EAGLE-3 on
    SmolLM2 at batch 1) leaves speculation on: it goes off on an optimistic alpha, not on the
    estimate those four pushed to about 0.2."""
    controller = AutoKController(k_max=3, probe_interval=32)
    for _ in range(auto_k.UNTIMED_STEPS):  # the prompts' step and the drafter's catch-up: acceptance only
        controller.record_step(0.1, controller.next_k(1), [1], [0])
    assert controller.next_k(1) == 0  # the plain probe
    controller.record_step(0.040, 0, [0], [0])
    for _ in range(4):
        k = controller.next_k(1)
        assert k > 0
        controller.record_step(0.040 * (1 + 0.2 * k), k, [k], [0])
    costs = [controller.step_cost(1, k) for k in (1, 2, 3)]
    assert controller.alpha < 0.3 and choose_k_for_costs(controller.alpha, costs) == 0  # the estimate would stop
    assert controller.optimistic_alpha > controller.alpha and controller.next_k(1) > 0
    # with acceptances coming in, it keeps drafting, at the estimate's best k
    for _ in range(20):
        k = controller.next_k(1)
        controller.record_step(0.040 * (1 + 0.2 * k), k, [k], [min(k, 1)])
    assert controller.alpha > 0.4 and controller.next_k(1) > 0


def test_controller_keeps_c_per_batch_size():
    # rows finish: 8 rows where drafts cost too much, then the last row alone, where they are cheap
    def rows_of_step(step):
        return 8 if step < 150 else 1

    controller = AutoKController(k_max=8, probe_interval=32)
    chosen = simulate(controller, 0.6, lambda rows: 0.02 if rows == 1 else 1.0, rows_of_step, steps=200)
    assert controller.c(8) > 0.5 and controller.c(1) == pytest.approx(0.02, abs=0.02)
    assert sum(k > 0 for k in chosen[100:150]) <= 2  # off at 8 rows (an exploratory step at most)
    # alone, the row speculates at once: its c is its own, not the 8-row batch's (a shared c, decaying
    # 0.9 per step from above 0.5, would keep it off for ten steps or more)
    assert chosen[150] == 0  # the plain probe a new batch size needs
    assert sum(k > 0 for k in chosen[151:200]) >= 47  # then drafts, but for one periodic probe
    assert controller.c(4) == pytest.approx(0.1)  # an unmeasured size: the prior


def test_controller_prices_each_k_by_its_own_steps():
    """A step cost that is not a line in k, as on the Intel Xeon (a forward of 1-3 new tokens per row
    costs about one of 1, 4+ cost 1.5x): the k the measured costs favour, not the line's."""

    def cost_of(rows, k):
        return 1.0 if k == 0 else 1.05 if k <= 3 else 1.8

    alpha = 0.7
    assert choose_k_for_costs(alpha, [cost_of(1, k) for k in range(1, 9)]) == 3
    controller = AutoKController(k_max=8, probe_interval=32)
    chosen = simulate(controller, alpha, None, lambda step: 1, steps=400, cost_of=cost_of)
    late = [k for k in chosen[100:] if k > 0]
    assert late.count(3) >= 0.9 * len(late), sorted(set(late))
    assert controller.step_cost(1, 3) == pytest.approx(1.05, abs=0.03)
    # k = 8 looked cheap on the line at first: tried, then priced by what it cost (the line's prior
    # still weighs as one step)
    assert 8 in chosen and controller.step_cost(1, 8) > 1.5
    # the single c fitted to the same steps (nearly all k = 3) prices k = 8 as cheap: on the line
    # alone the controller kept trying 4+ (it chose 3 and 4 about equally)
    assert 1 + controller.c(1) * 8 < 1.3


def test_depth_acceptance_reads_each_depth_and_leans_on_the_one_above():
    depths = DepthAcceptance(4, decay=1.0, prior_weight=2.0)
    assert depths.rates(0.5) == pytest.approx([0.5] * 4)  # nothing tried: every depth reads as the prior
    for _ in range(8):
        depths.record(drafted=2, accepted=1)  # depth 1 passes, depth 2 fails
    depths.record(drafted=2, accepted=2)
    a1, a2, a3, a4 = depths.rates(0.5)
    assert a1 == pytest.approx((9 + 1.0) / (9 + 2))
    assert a2 == pytest.approx((1 + 2 * a1) / (9 + 2))
    assert a3 == a4 == pytest.approx(a2)  # never tried: the depth above
    assert depths.expected_tokens(0.5)[:2] == pytest.approx([1 + a1, 1 + a1 + a1 * a2])
    depths.record(drafted=1, accepted=1)  # a row that drafted one and took it says nothing of depth 2
    assert depths.rates(0.5)[1] == pytest.approx((1 + 2 * depths.rates(0.5)[0]) / (9 + 2))


def test_controller_chooses_k_on_each_depths_acceptance():
    """A head whose first draft is right 80% of the time and later ones never (trained to draft one step):
    further drafts only cost. The pooled alpha says 0.8 for every depth where k = 1 runs, and a mix of depths
    where a larger k runs; each depth's own acceptance picks k = 1 (the pooled alpha alone kept to k = 2-3)."""
    rng = random.Random(0)
    controller = AutoKController(k_max=8, probe_interval=32)
    chosen = []
    for _ in range(400):
        k = controller.next_k(1)
        chosen.append(k)
        accepted = 0
        while accepted < k and accepted == 0 and rng.random() < 0.8:
            accepted += 1
        controller.record_step(0.01 * (1 + 0.1 * k) * (1 + 0.02 * (rng.random() - 0.5)), k, [k], [accepted])
    late = [k for k in chosen[100:] if k > 0]
    assert late.count(1) >= 0.8 * len(late), sorted(set(late))
    assert choose_k(controller.alpha, 0.1, 8) >= 2  # what the pooled alpha alone would have chosen


def test_a_stalled_step_moves_its_ks_price_by_a_bounded_amount():
    """A CPU VM stalls now and then: a step at twice its measured price counts as STEP_TIME_CLIP of it, so its
    k keeps its place; the first time a k runs, its time counts whole (it replaces the line's guess)."""
    controller = AutoKController(k_max=4, probe_interval=1000)
    for _ in range(auto_k.UNTIMED_STEPS):
        controller.record_step(0.1, 2, [2], [1])
    controller.record_step(0.040, 0, [0], [0])  # the plain time: 40 ms
    controller.record_step(0.1, 2, [2], [1])  # the head's catch-up after a plain step: untimed
    controller.record_step(0.080, 2, [2], [1])  # k = 2's first timed step: dear, and taken whole
    first = controller.step_cost(1, 2)
    assert first > 1.5
    for _ in range(30):
        controller.record_step(0.044, 2, [2], [1])
    settled = controller.step_cost(1, 2)
    assert settled == pytest.approx(1.1, abs=0.02)
    weight = controller._decay * controller._step_seconds[(1, 2)].denominator
    controller.record_step(0.088, 2, [2], [1])  # a stall: twice the price
    stalled_price = settled * (weight + auto_k.STEP_TIME_CLIP) / (weight + 1)
    assert controller.step_cost(1, 2) == pytest.approx(stalled_price, rel=0.02)
    controller.record_step(0.080, 0, [0], [0])  # a stalled plain step: at most STEP_TIME_CLIP of the plain time
    assert controller._plain[1].seconds.value <= 0.040 * (auto_k.PLAIN_DECAY + auto_k.STEP_TIME_CLIP) / (auto_k.PLAIN_DECAY + 1) + 1e-9


def test_a_batch_that_ends_together_chooses_k_for_its_last_row():
    """Two rows: row 0 takes every draft, row 1 finds none (an n-gram lookup without a match). Pooled, alpha
    stays high and k large; for the row furthest from its end (row 1) a step yields one token whatever k,
    so drafting only costs: off there. Its alpha starts from the pooled one and is forgotten per batch."""
    controller = AutoKController(k_max=8)
    controller.record_step(0.040, 0, [0, 0], [0, 0])  # a plain step: 40 ms at 2 rows
    for _ in range(30):
        k = controller.next_k(2)
        controller.record_step(0.040 * (1 + 0.05 * k), k, [k, 0], [k, 0], rows=[0, 1])
    assert controller.alpha > 0.9 and controller.next_k(2) >= 4
    assert controller.next_k(2, last_row=1) == 0
    assert controller.next_k(2, last_row=0) >= 4
    controller.record_step(0.030, 0, [0], [0])  # a plain step at one row
    assert controller.next_k(1, last_row=1) >= 4  # one row: the pooled estimate (carried across calls) decides
    controller.begin_batch()
    assert controller.next_k(2, last_row=1) >= 4  # a new batch's row 1 is another prompt: the pooled estimate again


def test_choose_k_for_costs():
    assert choose_k_for_costs(0.7, [1.0, 1.0, 1.0]) == 3  # free drafts: as many as allowed
    assert choose_k_for_costs(0.7, [1.1, 1.1, 1.5]) == 2
    assert choose_k_for_costs(0.2, [1.5, 2.0]) == 0  # every k loses
    assert best_k_for_costs(0.2, [1.5, 2.0]) == 1
    # on the line 1 + c k it is choose_k
    for alpha, c in [(0.8, 0.05), (0.55, 0.2), (0.1, 0.5)]:
        assert choose_k_for_costs(alpha, [1 + c * k for k in range(1, 9)]) == choose_k(alpha, c, 8)
    for bad in ([], [1.0, 0.0]):
        with pytest.raises(ValueError, match="step_costs"):
            best_k_for_costs(0.5, bad)


def test_controller_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k_max"):
        AutoKController(k_max=0)
    with pytest.raises(ValueError, match="probe_interval"):
        AutoKController(k_max=4, probe_interval=1)


# --- the loop with "auto" -------------------------------------------------------------------------


class RecordingProposer:
    """Wraps the loop's drafter and records, per step, the per-row limit and the drafts proposed."""

    def __init__(self, inner):
        self.inner = inner
        self.steps: list[list[tuple[int, int]]] = []

    def propose(self, request):
        proposal = self.inner.propose(request)
        self.steps.append(list(zip(request.max_draft_tokens, proposal.num_draft_tokens)))
        return proposal

    def release(self, rows, token_ids=None):
        self.inner.release(rows, token_ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _auto_config(method: str, k_max: int) -> dict:
    if method == "ngram":
        return ngram_config("auto", 1, 4, max_speculative_tokens=k_max)
    if method == "layer_skip":
        return {
            "method": "layer_skip",
            "early_exit_layer": 1,
            "num_speculative_tokens": "auto",
            "max_speculative_tokens": k_max,
        }
    return {
        "method": "draft_model",
        "model": build_tiny_llama(),
        "num_speculative_tokens": "auto",
        "max_speculative_tokens": k_max,
    }


@pytest.mark.parametrize(
    "method,batch_size", [("ngram", 1), ("ngram", 3), ("layer_skip", 3), ("draft_model", 3)]
)
def test_auto_greedy_matches_plain_generate(enabled_llama, monkeypatch, method, batch_size):
    model = enabled_llama
    auto_k.forget(model)  # from the priors, not from what an earlier test's calls taught it
    inputs = repeated_span_batch(batch_size)
    k_max = 6
    proposers = []

    def recording_build_proposer(*args, **kwargs):
        proposers.append(RecordingProposer(build_proposer(*args, **kwargs)))
        return proposers[-1]

    build_proposer = engine.build_proposer
    monkeypatch.setattr(engine, "build_proposer", recording_build_proposer)
    chosen, recorded = [], []
    next_k, record_step = AutoKController.next_k, AutoKController.record_step
    monkeypatch.setattr(AutoKController, "next_k", lambda self, *args: chosen.append(next_k(self, *args)) or chosen[-1])
    monkeypatch.setattr(
        AutoKController, "record_step", lambda self, seconds, k, *rest: recorded.append(k) or record_step(self, seconds, k, *rest)
    )
    plain = plain_generate(model, **inputs, max_new_tokens=40, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=40,
        do_sample=False,
        speculative_config=_auto_config(method, k_max),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    metrics = out.spec_metrics
    assert out.spec_metrics["num_draft_tokens"] > 0
    counts = metrics["k_chosen_counts"]
    assert sum(counts) == metrics["num_target_forwards"]
    assert len(counts) <= k_max + 1
    assert counts[0] >= 1, "no plain step was measured"
    # the prefill step speculates on the priors: k = choose_k(0.5, 0.1, 6) = 2, below the drafter's 6
    assert choose_k(0.5, 0.1, k_max) == 2 and counts[2] >= 1
    assert metrics["mean_k_chosen"] == pytest.approx(sum(k * n for k, n in enumerate(counts)) / sum(counts))
    # every drafter (built for k_max) honours each step's smaller limit
    steps = proposers[0].steps
    assert len(steps) == metrics["num_target_forwards"]
    assert all(drafted <= limit <= k_max for step in steps for limit, drafted in step)
    assert any(0 < limit < k_max for step in steps for limit, _ in step)
    assert recorded == chosen  # the loop books each step's timing under the k that step ran with


def test_auto_k_carries_what_it_learned_to_the_next_call(enabled_llama):
    """The second call with the same config and sampling mode continues the first's controller (its
    prompt step still not timed); another config, the other sampling mode or `forget` start afresh."""
    model, inputs = enabled_llama, repeated_span_batch(1)
    auto_k.forget(model)
    config = SpeculativeConfig.from_any(ngram_config("auto", 1, 4, max_speculative_tokens=5))
    first = auto_k.controller_for(model, config, do_sample=False)
    generated = model.generate(**inputs, max_new_tokens=24, do_sample=False, speculative_config=config.to_dict())
    learned_steps = first._steps
    assert learned_steps > 1 and not first._untimed_steps
    again = auto_k.controller_for(model, SpeculativeConfig.from_any(config.to_dict()), do_sample=False)
    assert again is first and again._untimed_steps == auto_k.UNTIMED_STEPS and again._steps == learned_steps
    assert torch.equal(
        model.generate(**inputs, max_new_tokens=24, do_sample=False, speculative_config=config.to_dict()), generated
    )
    assert first._steps > learned_steps  # the second call's steps went to the same controller
    assert auto_k.controller_for(model, config, do_sample=True) is not first
    other = SpeculativeConfig.from_any(ngram_config("auto", 1, 4, max_speculative_tokens=4))
    assert auto_k.controller_for(model, other, do_sample=False) is not first
    auto_k.forget(model)
    assert auto_k.controller_for(model, config, do_sample=False) is not first


def test_fixed_k_records_its_k_and_disable_by_batch_size_records_zero(enabled_llama):
    inputs = repeated_span_batch(3)
    out = enabled_llama.generate(
        **inputs,
        max_new_tokens=20,
        do_sample=False,
        speculative_config=ngram_config(4),
        return_dict_in_generate=True,
    )
    counts = out.spec_metrics["k_chosen_counts"]
    assert counts == [0, 0, 0, 0, out.spec_metrics["num_target_forwards"]]
    off = enabled_llama.generate(
        **inputs,
        max_new_tokens=20,
        do_sample=False,
        speculative_config=ngram_config(4, disable_by_batch_size=2),
        return_dict_in_generate=True,
    )
    # the three rows run to max_new_tokens together: every step has >= 2 rows and asks for k = 0
    assert off.spec_metrics["k_chosen_counts"] == [off.spec_metrics["num_target_forwards"]]
    assert off.spec_metrics["num_draft_tokens"] == 0


def test_metrics_conditional_acceptance_and_merge():
    metrics = SpecDecodeMetrics()
    metrics.record_step([4, 4, 0], [4, 1, 0], 4)  # one draft accepted whole, one rejected at position 2
    metrics.record_step([2], [0], 2)
    assert metrics.num_rejected_drafts == 2
    assert metrics.num_row_steps == 4
    assert metrics.conditional_acceptance_rate == pytest.approx(5 / 7)  # 5 accepted in 5 + 2 trials
    assert metrics.draft_acceptance_rate == pytest.approx(5 / 10)
    assert metrics.k_chosen_counts == [0, 0, 1, 0, 1]
    total = SpecDecodeMetrics.from_dict(json.loads(json.dumps(metrics.to_dict())))
    total.merge(metrics)
    assert total.k_chosen_counts == [0, 0, 2, 0, 2]
    assert total.num_rejected_drafts == 4 and total.mean_k_chosen == 3.0


# --- configuration --------------------------------------------------------------------------------


def test_auto_config_forms():
    for form in (
        {"num_speculative_tokens": "auto"},
        '{"method": "ngram", "num_speculative_tokens": "auto"}',
    ):
        config = SpeculativeConfig.from_any(form)
        assert config.auto_k and config.max_speculative_tokens == 8 and config.max_draft_tokens == 8
    config = SpeculativeConfig(num_speculative_tokens="auto", max_speculative_tokens=3)
    assert config.max_draft_tokens == 3 and config.to_dict()["num_speculative_tokens"] == "auto"
    fixed = SpeculativeConfig(num_speculative_tokens=5)
    assert not fixed.auto_k and fixed.max_draft_tokens == 5 and fixed.max_speculative_tokens is None


@pytest.mark.parametrize(
    "kwargs,field,fragment",
    [
        ({"num_speculative_tokens": "Auto"}, "num_speculative_tokens", "'auto'"),
        ({"num_speculative_tokens": "5"}, "num_speculative_tokens", "'auto'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens", "1 to 32, or 'auto'"),
        (
            {"num_speculative_tokens": "auto", "max_speculative_tokens": 0},
            "max_speculative_tokens",
            "1 to 32",
        ),
        (
            {"num_speculative_tokens": "auto", "max_speculative_tokens": 33},
            "max_speculative_tokens",
            "1 to 32",
        ),
        (
            {"num_speculative_tokens": "auto", "max_speculative_tokens": "8"},
            "max_speculative_tokens",
            "integer",
        ),
        (
            {"num_speculative_tokens": 4, "max_speculative_tokens": 8},
            "max_speculative_tokens",
            "only used with",
        ),
        ({"max_speculative_tokens": 8}, "max_speculative_tokens", "'auto'"),
    ],
)
def test_auto_config_errors(kwargs, field, fragment):
    for build in (
        lambda: SpeculativeConfig(**kwargs),
        lambda: SpeculativeConfig.from_any(json.dumps(kwargs)),
    ):
        with pytest.raises(ValueError) as info:
            build()
        assert f"speculative_config.{field}" in str(info.value)
        assert fragment in str(info.value)


def test_auto_through_custom_generate(tiny_llama):
    inputs = repeated_span_batch(1)
    plain = tiny_llama.generate(**inputs, max_new_tokens=24, do_sample=False)
    out = tiny_llama.generate(
        **inputs,
        max_new_tokens=24,
        do_sample=False,
        custom_generate=hf_specdec.generate,
        speculative_config='{"method": "ngram", "num_speculative_tokens": "auto"}',
    )
    assert torch.equal(out, plain)


def test_auto_sampling_matches_exact_distribution(monkeypatch):
    """Sampling with a k that changes from step to step still follows the target's distribution."""
    from conftest import build_small_vocab_llama
    from test_sampling_distribution import (
        NGRAM_CONFIG,
        SETTINGS,
        chi_square_pvalue,
        exact_distribution,
        speculative_samples,
    )

    chosen: list[int] = []
    next_k = AutoKController.next_k
    monkeypatch.setattr(AutoKController, "next_k", lambda self, *args: chosen.append(next_k(self, *args)) or chosen[-1])
    # every call from the priors (a 3-token call is too short to probe): carried over, a call whose
    # drafts did not pay would leave the next ones drafting nothing, and they must draft
    monkeypatch.setattr(engine, "controller_for", lambda model, config, do_sample: AutoKController(config.max_draft_tokens))
    model = hf_specdec.enable(build_small_vocab_llama())
    sampling = SETTINGS["temperature_topk_topp"]
    config = {**NGRAM_CONFIG, "num_speculative_tokens": "auto", "max_speculative_tokens": 4}
    samples, _ = speculative_samples(model, sampling, config, num_samples=4000, seed=1234)
    assert len(set(chosen)) > 1, chosen  # k really varied (a probe step at least)
    assert chi_square_pvalue(samples, exact_distribution(model, sampling)) > 1e-3


def test_auto_k_replay_benchmark_steps_along_recorded_acceptance():
    """`benchmarks/auto_k_replay.py`: a step at position p with k drafts takes min(m_p, k) of them and moves on
    past them and the target's own token; time is each step's price in plain steps."""
    from conftest import load_benchmark

    replay_module = load_benchmark("auto_k_replay")
    assert replay_module.match_lengths(torch.tensor([[0, 0, 3], [1, 0, 0], [0, 2, 0]])) == [2, 0, 1]
    lengths = [3, 9, 9, 0, 1, 9, 9, 9]  # m_p along an answer of 8 positions
    costs = [1.2, 1.5, 1.8]
    (per_answer,), ks = replay_module.replay([lengths], 2, costs, noise=0.0, stalls=0.0, stall_factor=2.0, seed=0)
    # p=0: takes 2, to p=3; p=3: takes 0, to 4; p=4: takes 1, to 6; p=6: takes 2, to 9
    assert ks == [2, 2, 2, 2] and per_answer == (8, pytest.approx(4 * 1.5))
    (stalled,), _ = replay_module.replay([lengths], 2, costs, noise=0.0, stalls=1.0, stall_factor=2.0, seed=0)
    assert stalled[1] == pytest.approx(2 * 4 * 1.5)
    controller = AutoKController(3)
    (auto,), auto_ks = replay_module.replay([lengths * 8], controller, costs, noise=0.0, stalls=0.0, stall_factor=2.0, seed=0)
    assert auto[0] == 64 and 0 in auto_ks and controller._steps == len(auto_ks)
