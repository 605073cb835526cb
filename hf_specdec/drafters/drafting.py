"""What the drafters that run a model share (draft model, layer skip, MTP).

- `DraftSampling` / `DraftTokenPicker`: how a draft token is chosen. When the target is greedy,
  the argmax of the draft logits (deterministic drafts: `draft_probs` None, one-hot q). When the
  target samples, the draft token is *sampled* from q = softmax(processed draft logits) with a
  per-row generator, and q is returned: the rejection sampler then does the full p/q test
  (accept with min(1, p/q), recover from max(0, p - q)), whose output follows p for any q. q
  only has to be the exact distribution the token was drawn from; how close it is to p sets the
  acceptance rate. "Processed" means the position-free warpers of the request (temperature,
  top-k, top-p, min-p, ...): they need no prefix, so one call covers every row. Processors that
  read the prefix (repetition penalty, no-repeat-ngram, ...) are left to the target: skipping
  them changes q, never the output distribution.
- `rows_to_feed`: which rows a drafter reading the target's hidden states (EAGLE, MTP) feeds
  this call: those drafting, and those whose waiting features reached `MAX_PENDING_POSITIONS`.
- `autoregressive_drafts`: k draft steps batched over rows into packed varlen forwards over a
  `PagedKVCache`, exactly as the loop drives the target: the first forward feeds each row's
  tokens the drafter has not cached yet, the next ones one token per row, through the same
  `forward_tokens` as the target's verify (a draft model, or the target's early exit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

from ..cache.forward import forward_tokens
from ..cache.paged_cache import PagedKVCache
from ..config import SpeculativeConfig
from ..sampling.logits_processing import _POSITION_FREE, apply_position_free
from ..transfer import to_device
from .base import ProposeRequest

# Draft generators must not share a stream with the rejection sampler's (seeded seed + row): a
# draft drawn with the same numbers as its acceptance test is correlated with it, which biases
# the output. torch's CPU generator keeps only the low 32 bits of a seed (seed + 2**40 would give
# the very same stream), so each draft seed is hashed from (seed, row, this tag) instead.
DRAFT_STREAM_TAG = 0x0D5AF7

# a row that does not draft still feeds its waiting target features once this many wait: a long
# stretch without drafts (auto k = 0, n-gram matches) then holds bounded memory
MAX_PENDING_POSITIONS = 64

@dataclass
class DraftSampling:
    """Whether drafts are sampled, and with which processors and seed.

    `do_sample` False: greedy drafts. Otherwise each draft is sampled from q = softmax of the draft
    logits after `warpers`, with one generator per batch row seeded from `seed`.
    """

    do_sample: bool = False
    warpers: list = field(default_factory=list)
    seed: int = 0

    @classmethod
    def from_generate(
        cls,
        generation_config: GenerationConfig | None,
        logits_processor: LogitsProcessorList | None,
        config: SpeculativeConfig,
    ) -> DraftSampling:
        """Sampled drafts exactly when the target samples, warped like the target's logits."""
        if generation_config is None or not generation_config.do_sample:
            return cls()
        # drawn from torch's global generator after the sampler drew its own, so torch.manual_seed reproduces
        seed = config.seed if config.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        return cls.sampled(logits_processor or [], seed)

    @classmethod
    def sampled(cls, logits_processor: Sequence, seed: int) -> DraftSampling:
        """Sampled drafts, warped by the position-free processors among `logits_processor`."""
        return cls(do_sample=True, warpers=[p for p in logits_processor if isinstance(p, _POSITION_FREE)], seed=seed)


class DraftTokenPicker:
    """Turns draft logits into draft tokens (and their q when sampling), one generator per batch row.

    Every row drafts as `sampling` says, except rows given their own (`set_row_sampling`: the
    engine's requests, each with its own warpers and seed).
    """

    def __init__(self, sampling: DraftSampling, device: torch.device):
        self.sampling = sampling
        self.device = torch.device(device)
        self._generators: dict[int, torch.Generator] = {}
        self._row_sampling: dict[int, DraftSampling] = {}

    def set_row_sampling(self, row: int, sampling: DraftSampling) -> None:
        """`row` drafts as `sampling` says until it is released. Its draft stream is seeded from
        `sampling.seed` alone, so a seeded request drafts the same in whichever row it runs."""
        self._row_sampling[int(row)] = sampling
        self._generators.pop(int(row), None)

    def _sampling_of(self, row: int) -> DraftSampling:
        return self._row_sampling.get(int(row), self.sampling)

    def _generator(self, row: int) -> torch.Generator:
        generator = self._generators.get(row)
        if generator is None:
            own = self._row_sampling.get(row)
            # SeedSequence takes non-negative entropy only; a request's seed may be negative (as torch's)
            entropy = [self.sampling.seed % 2**64, row, DRAFT_STREAM_TAG] if own is None else [own.seed % 2**64, DRAFT_STREAM_TAG]
            seed = int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))
            generator = self._generators[row] = torch.Generator(device=self.device).manual_seed(seed)
        return generator

    def warp(self, logits: torch.Tensor, sampling: DraftSampling | None = None) -> torch.Tensor:
        """logits `[n, vocab]` -> the scores drafts are sampled from (float32): the position-free
        warpers of `sampling` (default: the picker's) applied when sampling, the logits as they are
        when greedy."""
        sampling = sampling or self.sampling
        scores = logits.float()
        if not sampling.do_sample:
            return scores
        # position-free warpers ignore input_ids; they still take a [rows, length] tensor
        placeholder_ids = torch.zeros((scores.shape[0], 1), dtype=torch.long, device=scores.device)
        for warper in sampling.warpers:
            scores = apply_position_free(warper, placeholder_ids, scores, logits)
        return scores

    def pick(self, logits: torch.Tensor, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits `[len(rows), vocab]` -> (tokens `[len(rows)]`, q `[len(rows), vocab]` float32 or None).

        q is None only while no row of the picker samples: a drafter stacks each row's q over its
        draft steps, so a call's steps must all give q or all not. A greedy row beside sampled ones
        gets its argmax with a one-hot q."""
        if not (self.sampling.do_sample or any(s.do_sample for s in self._row_sampling.values())):
            return logits.argmax(dim=-1), None
        samplings = [self._sampling_of(row) for row in rows]
        if all(s is self.sampling for s in samplings):
            return self._sample(logits, rows, self.sampling)
        tokens = logits.argmax(dim=-1)
        q = torch.nn.functional.one_hot(tokens, logits.shape[-1]).float()
        groups: dict[int, list[int]] = {}  # rows sharing one sampling, by its identity
        for i, sampling in enumerate(samplings):
            if sampling.do_sample:
                groups.setdefault(id(sampling), []).append(i)
        for indices in groups.values():
            (index,) = to_device([np.array(indices, dtype=np.int64)], logits.device)
            tokens[index], q[index] = self._sample(logits[index], [rows[i] for i in indices], samplings[indices[0]])
        return tokens, q

    def _sample(self, logits: torch.Tensor, rows: Sequence[int], sampling: DraftSampling) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.softmax(self.warp(logits, sampling), dim=-1)
        # inverse CDF: the first token whose cumulative mass exceeds u ~ U[0, total) is x with
        # probability q(x) (zero-mass tokens have empty intervals). In float64: float32's 24 bits,
        # summed over a 152k vocabulary, could shift the intervals by up to ~1% of the mass in all.
        # One uniform per row: the exponential race before drew a vocabulary's worth per row, most
        # of a sampled draft step's own time at 152k tokens (Qwen2.5-Coder pair at batch 8: 150 ms
        # a step beside 860 ms of drafter forwards)
        cdf = q.double().cumsum(dim=-1)
        uniform = torch.cat([
            torch.rand(1, generator=self._generator(int(row)), device=self.device, dtype=torch.float64) for row in rows
        ])  # fmt: skip
        threshold = (uniform * cdf[:, -1])[:, None]
        tokens = torch.searchsorted(cdf, threshold, right=True)[:, 0].clamp_max(q.shape[-1] - 1)
        return tokens, q

    def release(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._generators.pop(int(row), None)
            self._row_sampling.pop(int(row), None)


def set_row_sampling(proposer, row: int, sampling: DraftSampling) -> None:
    """Every draft picker of `proposer` (and of drafters it wraps) samples `row`'s drafts as
    `sampling` says; drafters without one (n-gram, suffix, EAGLE: deterministic drafts) are unaffected."""
    for part in vars(proposer).values():
        if isinstance(part, DraftTokenPicker):
            part.set_row_sampling(row, sampling)
        elif hasattr(part, "propose"):
            set_row_sampling(part, row, sampling)


def rows_to_feed(request: ProposeRequest) -> list[int]:
    """Indices into `request.rows` of the rows whose waiting target features are fed this call:
    the rows that may draft, and those with `MAX_PENDING_POSITIONS` or more waiting. A row with
    none waiting (before its first verify) is never among them: there is nothing to draft from.
    """
    pending = request.target_features
    if pending is None:
        return []
    return [
        i
        for i, row in enumerate(request.rows)
        if (waiting := pending.count(row)) > 0
        and (request.max_draft_tokens[i] > 0 or waiting >= MAX_PENDING_POSITIONS)
    ]


def drafter_pool_blocks(token_ids: Sequence[np.ndarray], max_length: int, k: int, block_size: int) -> int:
    """Blocks for a drafter's own KV pool, sized at its first call (every row present with its prompt).

    A row's drafter cache never holds more than its prompt + new tokens + k (its last step's drafts).
    """
    max_new = max(max_length - max(len(t) for t in token_ids), 0)
    return sum(-(-(len(t) + max_new + k + 1) // block_size) for t in token_ids)


def collect_drafts(
    steps: Sequence[tuple[Sequence[int], torch.Tensor, torch.Tensor | None]],
    drafts: list[list[int]],
    probs: list[list[torch.Tensor]],
) -> None:
    """Append each draft step's tokens (and q when sampling) to its rows' drafts: `steps` holds, per
    step, the indices of the rows that drafted, their tokens on the device and their q. The tokens
    of every step come to the host in one transfer."""
    if not steps:
        return
    host_tokens = torch.cat([tokens for _, tokens, _ in steps]).cpu().numpy()
    offset = 0
    for step_rows, _, q in steps:
        for j, i in enumerate(step_rows):
            drafts[i].append(int(host_tokens[offset + j]))
            if q is not None:
                probs[i].append(q[j])
        offset += len(step_rows)


def autoregressive_drafts(
    model: PreTrainedModel,
    cache: PagedKVCache,
    rows: Sequence[int],
    feeds: Sequence[np.ndarray],
    max_draft: Sequence[int],
    picker: DraftTokenPicker,
    device: torch.device,
    position_offsets: Sequence[int] | None = None,
) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """Up to `max_draft[i]` draft tokens for each row, all rows batched in every forward.

    Row `rows[i]` first feeds `feeds[i]` (at least one token: the tokens its cache lacks, the
    last being the context's last token), at positions continuing its cache length (plus
    `position_offsets[i]`: `ProposeRequest.position_offsets`); then each
    draft token is fed back, one per row, while the row wants more. The last draft is never fed,
    so afterwards the cache holds the context plus all drafts but the last.

    Returns the drafts of each row and, when sampling, each row's q stacked `[drafts, vocab]`
    (empty list entries when greedy).
    """
    # which rows draft at each step follows from max_draft alone, so the drafts stay on the device
    # and are fed back from there: one transfer to the host at the end, not one sync per draft step
    active = [i for i in range(len(rows)) if max_draft[i] > 0]
    lengths = np.array([len(feeds[i]) for i in active], dtype=np.int64)
    (fed,) = to_device([np.concatenate([np.asarray(feeds[i], dtype=np.int64) for i in active] or [np.zeros(0, np.int64)])], device)
    steps: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []  # (rows drafting, their tokens, q)
    drafted = np.zeros(len(rows), dtype=np.int64)
    offsets = np.zeros(len(rows), dtype=np.int64) if position_offsets is None else np.asarray(position_offsets)
    while active:
        active_rows = [int(rows[i]) for i in active]
        starts = np.array([cache.seq_lens.get(row, 0) for row in active_rows], dtype=np.int64) + offsets[active]
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
        keep = np.cumsum(lengths) - 1  # each row's last fed token predicts its next draft
        (position_ids,) = to_device([positions], device)
        logits = forward_tokens(model, cache, active_rows, lengths.tolist(), fed, position_ids, keep)
        tokens, q = picker.pick(logits, active_rows)
        steps.append((active, tokens, q))
        drafted[active] += 1
        wanting = [j for j, i in enumerate(active) if drafted[i] < max_draft[i]]
        active = [active[j] for j in wanting]
        lengths = np.ones(len(active), dtype=np.int64)
        if active:
            fed = tokens[to_device([np.array(wanting, dtype=np.int64)], device)[0]]
    drafts: list[list[int]] = [[] for _ in rows]
    probs: list[list[torch.Tensor]] = [[] for _ in rows]
    collect_drafts(steps, drafts, probs)
    draft_arrays = [np.array(d, dtype=np.int64) for d in drafts]
    return draft_arrays, [torch.stack(p) if p else None for p in probs]


def stack_draft_probs(per_row: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor | None:
    """Rows' q stacked in the flat row-major order of `DraftProposal.draft_probs`; None when greedy."""
    present = [p for p in per_row if p is not None]
    if not present:
        return None
    return torch.cat(present).to(device)
