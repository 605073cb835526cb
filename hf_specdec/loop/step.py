"""One speculative step over every running row: the loop that `generate()` and the engine share.

1. draft: the proposer gives each active row up to k tokens (ragged, possibly none); k is the
   config's, or with num_speculative_tokens="auto" chosen per step (`auto_k.py`);
2. verify: one target forward over every row's pending token(s) and drafts, packed varlen into
   the paged KV cache (a row that just joined has its whole prompt pending: its prefill rides along,
   or a chunk of it per step with `prefill_chunk`);
3. sample: logits processors at every verify position, then rejection sampling;
4. emit: append accepted drafts + the bonus / recovered token, apply stopping criteria per
   token, roll the cache back to the accepted length, release finished rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..cache.architectures import padding_ends_forward
from ..cache.forward import forward_tokens
from ..cache.paged_cache import PagedKVCache
from ..config import SpeculativeConfig
from ..drafters import DraftProposal, Proposer, ProposeRequest
from ..models.feature_capture import TargetFeatureCapture
from ..profiling import StepTimer
from ..sampling.logits_processing import StopChecker, accept_emitted, cut_forbidden_drafts, process_logits
from ..sampling.metadata import SpecDecodeMetadata
from ..sampling.rejection_sampler import draw_step_random, rejection_sample
from ..sampling.tree import tree_depths
from ..sampling.tree_acceptance import accept_tree
from ..tensor_parallel import agreed_seconds
from ..transfer import to_device
from .auto_k import AutoKController
from .auto_tree import AutoTreeController
from .metrics import SpecDecodeMetrics
from .tree_verify import tree_layout, tree_prefixes


@dataclass
class DecodeState:
    """Every row's tokens and how far each has got.

    `token_buffer` holds rows exactly as plain generate's `input_ids` would: left padding,
    prompt, generated tokens (then pad). Columns past a row's `seq_lens` are scratch space where
    drafts are written during verification. A row of the engine is a request's slot: no padding,
    and `finished` while the slot is free.
    """

    token_buffer: torch.Tensor  # [rows, width]
    pad_lens: np.ndarray  # left padding per row
    seq_lens: np.ndarray  # columns in use per row (padding included)
    num_cached: np.ndarray  # tokens per row whose K/V the cache holds
    finished: np.ndarray  # bool per row
    max_lengths: np.ndarray  # per row, the column count (padding included) at which it stops (<= width)
    pad_token_id: int
    # per row, added to a token's count to give its position: 0 but after an M-RoPE image or where the model counts from 1 (`cache/prefill.py`)
    position_offsets: np.ndarray

    def active_rows(self) -> np.ndarray:
        return np.flatnonzero(~self.finished)

    def tokens(self, row: int) -> np.ndarray:
        return self.token_buffer[row, self.pad_lens[row] : self.seq_lens[row]].numpy()

    def pending_tokens(self, row: int) -> torch.Tensor:
        """Tokens of the row not yet in the cache: the whole prompt at first, then the last token."""
        return self.token_buffer[row, self.pad_lens[row] + self.num_cached[row] : self.seq_lens[row]]


@dataclass
class SamplingState:
    is_greedy: torch.Tensor  # [batch] bool
    generators: list[torch.Generator | None]  # one per batch row, None for greedy rows


def speculative_step(
    model: PreTrainedModel,
    state: DecodeState,
    proposer: Proposer,
    cache: PagedKVCache,
    config: SpeculativeConfig,
    logits_processor: LogitsProcessorList,
    stop_checker: StopChecker,
    sampling: SamplingState,
    metrics: SpecDecodeMetrics,
    features: TargetFeatureCapture | None = None,
    k_controller: AutoKController | None = None,
    tree_controller: AutoTreeController | None = None,
    keep_logits: bool = False,
    prefill_chunk: int | None = None,
    ends_together: bool = False,
) -> list[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """One draft / verify / accept step over every active row.

    `features` (drafters with `target_feature_layers`): hooks capturing the target's hidden states;
    the accepted positions' ones wait in `features.pending` until the drafter takes them.
    `k_controller` (num_speculative_tokens="auto"): picks this step's k and learns from its timing;
    `tree_controller` (tree="auto"): the same for the tree's size. `prefill_chunk`: at most this many
    prompt tokens enter the forward per step (`prompt_chunks`); None: every prompt at once.
    `ends_together`: the batch ends when its last row does (generate()'s): auto k weighs the row furthest
    from its end (`auto_k.py`).

    Returns, per active row: (row, emitted tokens, their raw logits, their processed logits), the
    logits only with `keep_logits` (else None).
    """
    rows = state.active_rows()
    chunk_rows, chunk_lens = _NO_ROWS, _NO_ROWS
    if prefill_chunk is not None:
        rows, chunk_rows, chunk_lens = prompt_chunks(state, rows, prefill_chunk)
    if k_controller is not None and (len(chunk_rows) or ((state.seq_lens - state.pad_lens - state.num_cached)[rows] > 1).any()):
        k_controller.begin_call()  # a step feeding prompts, and the next (a drafter's catch-up), are not decode steps
    if not len(rows):  # every row is still feeding its prompt
        _feed_chunks_alone(model, cache, state, features, chunk_rows, chunk_lens)
        return []
    seq_lens = state.seq_lens[rows]

    # 1. draft: k drafts, never more than the row may still emit, minus the token the target adds
    timer = StepTimer(model.device)  # the parts' seconds for the metrics, and for a profile when one is active
    if k_controller is None:
        k = config.max_draft_tokens
    else:
        last_row = int(rows[np.argmax(state.max_lengths[rows] - state.seq_lens[rows])]) if ends_together else None
        k = k_controller.next_k(len(rows), last_row)
    if config.disable_by_batch_size is not None and len(rows) >= config.disable_by_batch_size:
        k = 0
    max_lengths = state.max_lengths[rows]
    max_draft = np.clip(np.minimum(k, max_lengths - seq_lens - 1), 0, None)
    tree_size = None if tree_controller is None else tree_controller.next_size(len(rows))
    proposal = proposer.propose(
        ProposeRequest(
            rows=rows.tolist(),
            token_ids=[state.tokens(r) for r in rows],
            max_draft_tokens=max_draft.tolist(),
            target_features=None if features is None else features.pending,
            max_tree_nodes=tree_size,
            position_offsets=state.position_offsets[rows].tolist(),
        )
    )
    trees = proposal.draft_parents  # None: every row's drafts are a chain
    # a deterministic draft a grammar or prefix_allowed_tokens_fn forbids cannot pass: cut it here (a tree's
    # are masked in the verify)
    if proposal.draft_probs is None and trees is None:
        proposal.draft_token_ids = cut_forbidden_drafts(
            logits_processor, rows, proposal.draft_token_ids,
            lambda row: state.token_buffer[row, : state.seq_lens[row]].to(model.device),
        )  # fmt: skip
    padding = padding_ends_forward(model)
    if padding is not None:  # a token after the padding id would read another position than one at a time
        proposal = proposal.shortened(_drafts_up_to(padding, [state.tokens(r)[-1] for r in rows], proposal.draft_token_ids))
    spec = SpecDecodeMetadata.from_drafts(proposal.draft_token_ids, device=model.device)
    num_draft = np.array(spec.num_draft_tokens, dtype=np.int64)
    metrics.draft_seconds += timer.lap("draft")

    # 2. verify: pending tokens + drafts of every row, packed into one forward (one per row for hybrids);
    # a tree's nodes sit at their depth's position and see only their ancestors (`tree_layout`)
    pending = [state.pending_tokens(r) for r in rows]
    num_pending = np.array([len(p) for p in pending], dtype=np.int64)
    segments = [np.concatenate([p.numpy(), d]) for p, d in zip(pending, proposal.draft_token_ids)]
    segment_lens = num_pending + num_draft
    # prompt chunks of rows still feeding theirs ride after the rows above: no drafts, no logits
    chunks = _chunk_tokens(state, chunk_rows, chunk_lens)
    positions, tree_mask = _verify_positions(state, rows, num_pending, segment_lens, trees, chunk_rows, chunk_lens)
    segment_ends = np.cumsum(segment_lens)
    # logits of the last pending token and of every draft: num_draft + 1 per row
    keep = np.concatenate([np.arange(end - n - 1, end) for end, n in zip(segment_ends, num_draft)])
    if features is not None:
        features.begin_forward()
    input_ids, position_ids = to_device([np.concatenate(segments + chunks), positions], model.device)
    logits = forward_tokens(
        model, cache, rows.tolist() + chunk_rows.tolist(), segment_lens.tolist() + chunk_lens.tolist(), input_ids,
        position_ids, keep, tree_mask=tree_mask,
    ).float()  # fmt: skip
    _pack_features(features, cache)
    _fed_chunks(state, features, chunk_rows, chunk_lens, first=int(segment_lens.sum()))
    metrics.record_kv_usage(cache.num_blocks_used, cache.blocks_needed(state.num_cached[rows] + num_pending))
    metrics.verify_seconds += timer.lap("verify")

    # 3. sample: processors see, at each position, the prefix plain generate would have had
    processed = _processed_logits(logits_processor, logits, state, rows, proposal.draft_token_ids, trees)
    metrics.sampler_seconds += timer.lap("logits_processing")
    output_tokens, num_accepted, accepted_nodes = _accept(spec, processed, proposal, sampling, rows, config)
    metrics.sampler_seconds += timer.lap("sampling")

    # 4. emit, stop, roll back
    num_accepted, output_tokens, paths = _to_host(num_accepted, output_tokens, accepted_nodes)
    for i, row in enumerate(rows):
        state.token_buffer[row, seq_lens[i] : seq_lens[i] + num_accepted[i] + 1] = output_tokens[i, : num_accepted[i] + 1]
    num_kept, stopped = stop_checker.first_stop(state.token_buffer, rows, seq_lens, num_accepted + 1, max_lengths)
    metrics.record_step(
        spec.num_draft_tokens, num_accepted.tolist(), k,
        draft_depths=None if trees is None else [int(tree_depths(p).max(initial=0)) for p in trees],
    )
    metrics.num_emitted_tokens += int(num_kept.sum())

    # the emitted tokens' logits only when asked for (at batch 8, k = 8 and a 152k vocabulary: 27 ms of a 2 s CPU step)
    raw_kept, processed_kept = _emitted_logits(logits, processed, num_draft, paths, num_kept) if keep_logits else (None, None)
    emitted_start = np.cumsum(num_kept) - num_kept
    emitted, moves = [], []
    for i, row in enumerate(rows):
        start, kept = int(seq_lens[i]), int(num_kept[i])
        state.token_buffer[row, start + kept : start + num_draft[i] + 1] = state.pad_token_id
        state.seq_lens[row] = start + kept
        window = slice(int(emitted_start[i]), int(emitted_start[i]) + kept)
        emitted.append((
            int(row), output_tokens[i, :kept],
            None if raw_kept is None else raw_kept[window], None if processed_kept is None else processed_kept[window],
        ))  # fmt: skip
        accept_emitted(logits_processor, int(row), output_tokens[i, :kept])
        if not stopped[i]:
            first_draft = int(state.num_cached[row] + num_pending[i])
            if trees is not None:  # the accepted path's K/V move into place after the pending tokens
                moves.append((int(row), first_draft + paths[i], first_draft + np.arange(len(paths[i]))))
            state.num_cached[row] = first_draft + num_accepted[i]
            if features is not None:  # the pending token(s) and accepted drafts are context now
                segment_start = int(segment_ends[i] - segment_lens[i])
                features.keep_at(
                    int(row), segment_start + np.concatenate([np.arange(num_pending[i]), num_pending[i] + paths[i]])
                )
    if moves:
        cache.move_tokens(moves)
    for i, row in enumerate(rows):
        if not stopped[i]:
            cache.rollback(int(row), int(state.num_cached[row]))
    if stopped.any():
        release_rows(state, cache, proposer, features, rows[stopped].tolist())
    timer.lap("emit")
    timer.finish(fed_prompt=bool(num_pending.max() > 1 or len(chunk_rows)))
    if k_controller is not None or tree_controller is not None:
        seconds = agreed_seconds(model, timer.elapsed())  # tensor-parallel ranks choose alike
    if tree_controller is not None and num_draft.any() and num_pending.max() == 1 and not len(chunk_rows):  # no prefill
        tree_controller.record_step(len(rows), tree_size, seconds, int(num_kept.sum()))
    if k_controller is not None:
        k_controller.record_step(seconds, k, spec.num_draft_tokens, num_accepted.tolist(), rows.tolist())
    return emitted


_NO_ROWS = np.zeros(0, dtype=np.int64)


def prompt_chunks(state: DecodeState, rows: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chunked prefill: which rows step as usual, and which only feed the next `chunk_lens` tokens of
    their prompt, at most `budget` prompt tokens in all (a decoding row has one pending token and
    always steps). Prompts already begun come first, so that new ones cannot starve them. A prompt
    that fits in what is left steps as usual (its last chunk); a row the budget does not reach
    waits. Returns (rows, chunk_rows, chunk_lens), each in row order."""
    pending = state.seq_lens[rows] - state.pad_lens[rows] - state.num_cached[rows]
    allotted = np.zeros(len(rows), dtype=np.int64)  # the pending tokens each row feeds this step
    for i in np.argsort(state.num_cached[rows] == 0, kind="stable"):
        if pending[i] == 1:  # decoding
            allotted[i] = 1
        else:
            allotted[i] = min(int(pending[i]), budget)
            budget -= int(allotted[i])
    stepping = allotted == pending
    chunking = (allotted > 0) & ~stepping
    return rows[stepping], rows[chunking], allotted[chunking]


def _chunk_tokens(state: DecodeState, rows: np.ndarray, lens: np.ndarray) -> list[np.ndarray]:
    """The tokens of each row's next prompt chunk."""
    return [state.pending_tokens(int(row))[: int(n)].numpy() for row, n in zip(rows, lens)]


def _feed_chunks_alone(
    model: PreTrainedModel, cache: PagedKVCache, state: DecodeState, features: TargetFeatureCapture | None,
    rows: np.ndarray, lens: np.ndarray,
) -> None:  # fmt: skip
    """A step in which every row only feeds a prompt chunk: one forward, no logits."""
    if features is not None:
        features.begin_forward()
    positions, _ = _verify_positions(state, _NO_ROWS, _NO_ROWS, _NO_ROWS, None, rows, lens)
    input_ids, position_ids = to_device([np.concatenate(_chunk_tokens(state, rows, lens)), positions], model.device)
    forward_tokens(model, cache, rows.tolist(), lens.tolist(), input_ids, position_ids, _NO_ROWS)
    _pack_features(features, cache)
    _fed_chunks(state, features, rows, lens, first=0)


def _pack_features(features: TargetFeatureCapture | None, cache: PagedKVCache) -> None:
    """A forward that laid its rows out side by side (a batch on the model's own cache) captured them so."""
    if features is not None and cache.batch_layout is not None:
        features.pack(cache.batch_layout.slots, cache.batch_layout.columns)


def _fed_chunks(
    state: DecodeState, features: TargetFeatureCapture | None, rows: np.ndarray, lens: np.ndarray, first: int
) -> None:
    """Prompt chunks packed from `first` on went through the forward: their K/V are in the cache, and
    their target features wait, held from the drafter, until the prompt's last chunk steps (a drafter
    then catches up on the whole prompt at once, as on an unchunked one)."""
    for row, n in zip(rows, lens):
        state.num_cached[row] += n
        if features is not None:
            features.hold_at(int(row), first + np.arange(n))
        first += int(n)


def release_rows(
    state: DecodeState, cache: PagedKVCache, proposer: Proposer, features: TargetFeatureCapture | None, rows: list[int]
) -> None:
    """Rows that finished (or were aborted): marked so, their KV blocks, drafter state and waiting
    target features freed."""
    for row in rows:
        state.finished[row] = True
        cache.free_row(int(row))
        if features is not None:
            features.drop(int(row))
    proposer.release(rows, [state.tokens(r) for r in rows])


def drafters_of(proposer) -> list:
    """The proposer and every drafter it wraps (`NgramFirstProposer`, `LookupFirstProposer`)."""
    found = [proposer]
    for part in vars(proposer).values():
        if hasattr(part, "propose"):
            found.extend(drafters_of(part))
    return found


def drafter_networks(proposer) -> list[torch.nn.Module]:
    """The modules a drafter runs, those of drafters it wraps (`NgramFirstProposer`) included."""
    return [part for drafter in drafters_of(proposer) for part in vars(drafter).values() if isinstance(part, torch.nn.Module)]


def _verify_positions(
    state: DecodeState, rows: np.ndarray, num_pending: np.ndarray, segment_lens: np.ndarray,
    trees: list[np.ndarray] | None, chunk_rows: np.ndarray, chunk_lens: np.ndarray,
) -> tuple[np.ndarray, torch.Tensor | None]:  # fmt: skip
    """The position of every token of the verify forward (the rows' segments, then the prompt chunks),
    and for draft trees the mask letting each node see only its ancestors (`tree_layout`)."""
    starts = np.concatenate([state.num_cached[rows], state.num_cached[chunk_rows]])
    starts += np.concatenate([state.position_offsets[rows], state.position_offsets[chunk_rows]])
    if trees is None:
        lens = np.concatenate([segment_lens, chunk_lens])
        return np.concatenate([np.arange(c, c + n) for c, n in zip(starts, lens)]), None
    # a chunk is a segment with no tree
    return tree_layout(starts, np.concatenate([num_pending, chunk_lens]), trees + [_NO_ROWS] * len(chunk_rows))


def _processed_logits(
    logits_processor: LogitsProcessorList, logits: torch.Tensor, state: DecodeState, rows: np.ndarray,
    draft_token_ids: list[np.ndarray], trees: list[np.ndarray] | None,
) -> torch.Tensor:  # fmt: skip
    """The verify logits through the processors, each position seeing the prefix plain generate()
    would have had there: the row's tokens and the drafts before it (a tree node: its path)."""
    if not logits_processor:
        return logits
    num_logits = np.array([len(d) for d in draft_token_ids], dtype=np.int64) + 1
    logits_rows = np.repeat(rows, num_logits)  # the batch row of each logits row
    if trees is not None:
        node_buffer, node_rows, prefix_lens = tree_prefixes(state, rows, draft_token_ids, trees)
        return process_logits(logits_processor, logits, node_buffer, node_rows, prefix_lens, batch_rows=logits_rows)
    seq_lens = state.seq_lens[rows]
    for row, start, drafts in zip(rows, seq_lens, draft_token_ids):
        state.token_buffer[row, start : start + len(drafts)] = torch.from_numpy(drafts)
    prefix_lens = np.repeat(seq_lens, num_logits) + _offsets_within(num_logits)
    return process_logits(logits_processor, logits, state.token_buffer, logits_rows, prefix_lens)


def _accept(
    spec: SpecDecodeMetadata, processed: torch.Tensor, proposal: DraftProposal, sampling: SamplingState, rows: np.ndarray,
    config: SpeculativeConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Greedy rows accept drafts equal to the argmax, sampled rows by rejection sampling (its random
    numbers drawn from each row's generator): (output tokens, drafts accepted, a tree's accepted nodes)."""
    generators = [sampling.generators[r] for r in rows]
    device = processed.device
    is_greedy = sampling.is_greedy[to_device([rows], device)[0]]
    is_tree, method = proposal.draft_parents is not None, config.rejection_sample_method
    draws = draw_step_random(generators, spec, processed, is_greedy, method, tree=is_tree)
    if is_tree:
        return accept_tree(spec, proposal.draft_parents, processed, is_greedy, draws=draws)
    output_tokens, num_accepted = rejection_sample(
        spec, processed, is_greedy, draws=draws, draft_probs=proposal.draft_probs, method=method
    )
    return output_tokens, num_accepted, None


def _to_host(
    num_accepted: torch.Tensor, output_tokens: torch.Tensor, accepted_nodes: torch.Tensor | None
) -> tuple[np.ndarray, torch.Tensor, list[np.ndarray]]:
    """The sampler's results on the host in one transfer (the step's one sync on GPUs): per row the
    drafts accepted, the output tokens, and the accepted drafts' indices in order (a chain's first
    ones, or a tree's accepted path)."""
    results = [num_accepted[:, None].to(output_tokens.dtype), output_tokens]
    if accepted_nodes is not None:
        results.append(accepted_nodes.to(output_tokens.dtype))
    results = torch.cat(results, dim=1).cpu()
    width = output_tokens.shape[1]
    num_accepted, output_tokens = results[:, 0].numpy(), results[:, 1 : 1 + width]
    if accepted_nodes is None:
        return num_accepted, output_tokens, [np.arange(a) for a in num_accepted]
    return num_accepted, output_tokens, [results[i, 1 + width :][:a].numpy() for i, a in enumerate(num_accepted)]


def _emitted_logits(
    logits: torch.Tensor, processed: torch.Tensor, num_draft: np.ndarray, paths: list[np.ndarray], num_kept: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw and processed logits of each emitted token, for every row at once: at the row's root,
    then at each accepted draft (consecutive for a chain)."""
    first_logit = np.cumsum(num_draft + 1) - (num_draft + 1)
    emitted = np.concatenate(
        [first + np.concatenate([[0], path + 1])[:kept] for first, path, kept in zip(first_logit, paths, num_kept)]
    )
    (index,) = to_device([emitted], logits.device)
    return logits[index], processed[index]


def _offsets_within(lengths: np.ndarray) -> np.ndarray:
    """[0, 1, ..., n0-1, 0, 1, ..., n1-1, ...]"""
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def _drafts_up_to(token: int, last_tokens: list[int], drafts: list[np.ndarray]) -> list[int]:
    """How many of each row's drafts to keep so that nothing follows `token` in the row's forward: none after a
    row's last token if it is `token`, else up to and with the first draft that is (a stopping rule on the
    drafts themselves: exact for sampled drafts too)."""
    lengths = []
    for last, row_drafts in zip(last_tokens, drafts):
        found = np.flatnonzero(row_drafts == token)
        lengths.append(0 if last == token else int(found[0]) + 1 if found.size else len(row_drafts))
    return lengths
