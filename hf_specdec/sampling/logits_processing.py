"""HF logits processors and stopping criteria applied at every verify / emitted position.

Plain `generate()` calls each processor with the whole sequence so far (left padding included)
and the next-token scores. A speculative step has several positions per row, each with its own
prefix (the row's tokens plus the drafts before it), so we call processors per position, with
exactly the prefix plain generate would have passed there. Positions whose prefixes have the
same length go through one call together (a processor sees a rectangular `input_ids`).
Processors that never read `input_ids` (temperature, top-k, top-p, min-p, ...) run once over
every position. Stopping criteria are checked the same way after each emitted token.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import logits_process, stopping_criteria

from ..transfer import to_device
from .grammar import SpeculativeGrammar, row_grammars
from .in_place import warp_in_place
from .prefix_constraint import SpeculativePrefixConstraint
from .top_p import warp_top_p

# Processors whose output does not depend on input_ids: one call covers every position.
_POSITION_FREE = tuple(
    getattr(logits_process, name)
    for name in (
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "MinPLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "TopHLogitsWarper",
        "LogitNormalization",
        "SuppressTokensLogitsProcessor",
        "InfNanRemoveLogitsProcessor",
    )
    if hasattr(logits_process, name)
)

# Processors that cannot be replayed per position: they call a model or keep state between calls.
_UNSUPPORTED = {
    "ClassifierFreeGuidanceLogitsProcessor": "it needs an unconditional model pass",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "it needs an unconditional model pass",
    "WatermarkLogitsProcessor": "it keeps random state between calls",
    "SynthIDTextWatermarkLogitsProcessor": "it keeps state between calls",
}


# Grammar processors of other libraries keep per-row parser state that a rejected draft would
# have to be rolled back out of; xgrammar's is replaced by `grammar.SpeculativeGrammar`
_UNSUPPORTED_LIBRARIES = {
    "outlines": "outlines keeps per-row parser state that speculation cannot roll back; use xgrammar's processor",
    "llguidance": "llguidance keeps per-row parser state that speculation cannot roll back; use xgrammar's processor",
}


def check_supported_processors(logits_processor: LogitsProcessorList) -> None:
    for processor in logits_processor:
        library = type(processor).__module__.split(".", 1)[0]
        reason = _UNSUPPORTED.get(type(processor).__name__) or _UNSUPPORTED_LIBRARIES.get(library)
        if reason:
            raise ValueError(
                f"{type(processor).__name__} is not supported with speculative decoding: {reason}. "
                "Remove it (or the generate() option that adds it)."
            )


def apply_position_free(
    processor: LogitsProcessor, input_ids: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """`processor(input_ids, scores)` for a processor in `_POSITION_FREE`; top-p over the tokens still in play
    (`top_p.py`); writing into `scores` where it does not share the memory of `logits` (the caller's): top-p,
    temperature and top-k (`in_place.py`)."""
    owned = scores.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
    if type(processor) is logits_process.TopPLogitsWarper:
        return warp_top_p(processor, input_ids, scores, in_place=owned)
    warped = warp_in_place(processor, scores) if owned else None
    return processor(input_ids, scores) if warped is None else warped


def _for_rows(processor, batch_rows: np.ndarray):
    """The processor as it applies to these batch rows (`spread_over_rows` gave it one entry per row).

    Some of transformers' processors hold a value per batch row, built from the whole batch: the
    repetition penalty's prompt-ignore lengths (the left padding generate() found), the encoder
    repetition penalty's source tokens, the encoder n-gram ban's source n-grams. The grouped call
    passes only some rows, in any order, a row once per position, so it gets theirs.
    """
    ignore = getattr(processor, "prompt_ignore_length", None)
    if isinstance(ignore, torch.Tensor):
        processor = copy.copy(processor)
        processor.prompt_ignore_length = ignore[to_device([batch_rows], ignore.device)[0]]
    elif isinstance(processor, logits_process.EncoderRepetitionPenaltyLogitsProcessor):
        processor = copy.copy(processor)
        processor.encoder_input_ids = processor.encoder_input_ids[to_device([batch_rows], processor.encoder_input_ids.device)[0]]
    elif isinstance(processor, logits_process.EncoderNoRepeatNGramLogitsProcessor):
        processor = copy.copy(processor)
        processor.generated_ngrams = [processor.generated_ngrams[row] for row in batch_rows]
        processor.batch_size = len(batch_rows)
    return processor


def spread_over_rows(logits_processor: LogitsProcessorList, batch_size: int) -> LogitsProcessorList:
    """The processors with the encoder-reading ones holding one source per batch row.

    generate() builds those from the prompts (an encoder-decoder model's sources) before
    `num_return_sequences` repeats each row, and they repeat the source themselves when called with
    the whole batch; `_for_rows` hands each position its own row's. The same list object back when
    there is none."""

    def spread(processor):
        if isinstance(processor, logits_process.EncoderRepetitionPenaltyLogitsProcessor):
            sources = len(processor.encoder_input_ids)
        elif isinstance(processor, logits_process.EncoderNoRepeatNGramLogitsProcessor):
            sources = processor.batch_size
        else:
            return processor
        if sources == batch_size:
            return processor
        if batch_size % sources:
            raise ValueError(
                f"{type(processor).__name__} holds {sources} sources for a batch of {batch_size} rows; "
                "it needs one per row or per prompt (num_return_sequences repeats them)"
            )
        return _for_rows(processor, np.arange(batch_size) // (batch_size // sources))

    spread_list = [spread(p) for p in logits_processor]
    if all(new is old for new, old in zip(spread_list, logits_processor)):
        return logits_processor
    return LogitsProcessorList(spread_list)


def _by_prefix_length(
    token_buffer: torch.Tensor,
    buffer_rows: np.ndarray,
    prefix_lens: np.ndarray,
    call: Callable[[torch.Tensor, np.ndarray], None],
) -> None:
    """Call `call(input_ids, positions)` once per distinct prefix length."""
    order = np.argsort(prefix_lens, kind="stable")
    bounds = np.flatnonzero(np.diff(prefix_lens[order])) + 1
    for positions in np.split(order, bounds):
        length = int(prefix_lens[positions[0]])
        input_ids = token_buffer[torch.from_numpy(buffer_rows[positions]), :length]
        call(input_ids, positions)


def process_logits(
    logits_processor: LogitsProcessorList,
    logits: torch.Tensor,
    token_buffer: torch.Tensor,
    buffer_rows: np.ndarray,
    prefix_lens: np.ndarray,
    batch_rows: np.ndarray | None = None,
) -> torch.Tensor:
    """Processed scores for each row of `logits`; row i's prefix is `token_buffer[buffer_rows[i], :prefix_lens[i]]`
    and it belongs to batch row `batch_rows[i]` (default: the buffer row; a tree's nodes each have a
    buffer row of their own, holding the path to the node)."""
    batch_rows = buffer_rows if batch_rows is None else batch_rows
    scores = logits
    for processor in logits_processor:
        # a grammar walks each row's drafts through its matcher, a prefix constraint asks for each position
        # not past a draft it forbids; per-request processors dispatch by row
        if isinstance(processor, (SpeculativeGrammar, SpeculativePrefixConstraint, RowLogitsProcessors)):
            scores = processor.process(scores, token_buffer, buffer_rows, prefix_lens, batch_rows)
            continue
        if isinstance(processor, _POSITION_FREE):
            scores = apply_position_free(processor, to_device([token_buffer[:1].numpy()], scores.device)[0], scores, logits)
            continue
        processed = torch.empty_like(scores)

        def apply(input_ids: torch.Tensor, positions: np.ndarray, processor=processor, scores=scores, out=processed):
            index, input_ids = to_device([positions, input_ids.numpy()], scores.device)
            row_processor = _for_rows(processor, batch_rows[positions])
            out[index] = row_processor(input_ids, scores[index])  # (indexing by a tensor copies)

        _by_prefix_length(token_buffer, buffer_rows, prefix_lens, apply)
        scores = processed
    return scores


def cut_forbidden_drafts(
    logits_processor: LogitsProcessorList, rows: np.ndarray, drafts: list[np.ndarray],
    prefix_of: Callable[[int], torch.Tensor],
) -> list[np.ndarray]:  # fmt: skip
    """Each row's deterministic drafts up to the first one a constraint (a grammar, `prefix_allowed_tokens_fn`)
    forbids; `prefix_of(row)`: the row's tokens as plain generate() holds them (see `grammar.py` for why only
    drafts that carry no q of their own may be cut)."""
    cut = []
    for row, row_drafts in zip(rows, drafts):
        constraints = _row_constraints(logits_processor, int(row))
        if constraints and len(row_drafts):
            prefix = prefix_of(int(row))
            row_drafts = row_drafts[: min(c.allowed_drafts(at, prefix, row_drafts) for c, at in constraints)]
        cut.append(row_drafts)
    return cut


def _row_constraints(logits_processor: LogitsProcessorList, row: int) -> list[tuple[object, int]]:
    """The processors constraining batch row `row` that can cut its drafts, each with the row's index in
    it: the batch's (generate()), or its request's own (the engine's per-row processors: a batch of one)."""
    kinds = (SpeculativeGrammar, SpeculativePrefixConstraint)
    found = [(processor, row) for processor in logits_processor if isinstance(processor, kinds)]
    for processor in logits_processor:
        if isinstance(processor, RowLogitsProcessors):
            found.extend((p, 0) for p in processor.by_row.get(row, ()) if isinstance(p, kinds))
    return found


def accept_emitted(logits_processor: LogitsProcessorList, row: int, tokens: torch.Tensor) -> None:
    """Tell the processors that keep per-row state (grammars) what the row emitted this step."""
    for grammar, at in row_grammars(logits_processor, row):
        grammar.accept_emitted(at, tokens)


class StopChecker:
    """Finds, for each row, the first emitted token after which generation must stop."""

    def __init__(self, criteria: StoppingCriteriaList):
        self.max_length: int | None = None
        self.eos_token_ids: torch.Tensor | None = None
        self.other: list = []
        for criterion in criteria:
            if isinstance(criterion, stopping_criteria.MaxLengthCriteria):
                self.max_length = min(criterion.max_length, self.max_length or criterion.max_length)
            elif isinstance(criterion, stopping_criteria.EosTokenCriteria):
                ids = criterion.eos_token_id.flatten().cpu()
                self.eos_token_ids = ids if self.eos_token_ids is None else torch.cat([self.eos_token_ids, ids])
            else:
                self.other.append(criterion)

    def first_stop(
        self,
        token_buffer: torch.Tensor,
        rows: np.ndarray,
        start_lens: np.ndarray,
        num_emitted: np.ndarray,
        max_lengths: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tokens to keep per row: the emitted count, or up to and including the first stop.

        Row `rows[i]` emitted `num_emitted[i]` tokens, already written in `token_buffer` from
        column `start_lens[i]` on; it also stops on reaching `max_lengths[i]` columns (each engine
        request has its own). Returns `(keep, stopped)`.
        """
        max_emitted = int(num_emitted.max())
        offsets = np.arange(max_emitted)
        emitted = offsets[None, :] < num_emitted[:, None]
        prefix_lens = start_lens[:, None] + offsets[None, :] + 1  # length once token j is appended
        stop = np.zeros_like(emitted)
        if self.max_length is not None:
            stop |= prefix_lens >= self.max_length
        if max_lengths is not None:
            stop |= prefix_lens >= np.asarray(max_lengths)[:, None]
        if self.eos_token_ids is not None:
            columns = torch.from_numpy(np.minimum(prefix_lens - 1, token_buffer.shape[1] - 1))
            tokens = token_buffer[torch.from_numpy(rows)[:, None], columns]
            stop |= torch.isin(tokens, self.eos_token_ids.to(tokens.device)).cpu().numpy()
        if self.other:
            flat_rows, flat_offsets = np.nonzero(emitted)
            flat_stop = np.zeros(len(flat_rows), dtype=bool)

            def check(input_ids: torch.Tensor, positions: np.ndarray) -> None:
                done = torch.zeros(len(positions), dtype=torch.bool, device=input_ids.device)
                for criterion in self.other:
                    done |= criterion(input_ids, None)
                flat_stop[positions] = done.cpu().numpy()

            _by_prefix_length(token_buffer, rows[flat_rows], prefix_lens[flat_rows, flat_offsets], check)
            stop[flat_rows, flat_offsets] |= flat_stop
        stop &= emitted
        stopped = stop.any(axis=1)
        keep = np.where(stopped, stop.argmax(axis=1) + 1, num_emitted)
        return keep, stopped


class RowLogitsProcessors:
    """Each row's own processors: the engine's requests bring theirs (temperature, top-p, penalties).

    Inside a `LogitsProcessorList` it gets, from `process_logits`, every position with its batch row
    and prefix; each row's positions go through that row's processors alone, as batch row 0 (a
    processor holding per-batch-row values, the repetition penalty's prompt lengths, was built for
    its request alone).
    """

    def __init__(self):
        self.by_row: dict[int, LogitsProcessorList] = {}

    def any_for(self, rows: np.ndarray) -> bool:
        return any(self.by_row.get(int(row)) for row in rows)

    def process(
        self, scores: torch.Tensor, token_buffer: torch.Tensor, buffer_rows: np.ndarray, prefix_lens: np.ndarray,
        batch_rows: np.ndarray,
    ) -> torch.Tensor:  # fmt: skip
        processed = scores
        for row in np.unique(batch_rows):
            processors = self.by_row.get(int(row))
            if not processors:
                continue
            if processed is scores:
                processed = scores.clone()
            positions = np.flatnonzero(batch_rows == row)
            (index,) = to_device([positions], scores.device)
            processed[index] = process_logits(
                processors, scores[index], token_buffer, buffer_rows[positions], prefix_lens[positions],
                np.zeros(len(positions), dtype=np.int64),
            )
        return processed


class RowStopCheckers:
    """Each row's own `StopChecker` (an engine request's eos ids and stop strings); rows sharing one
    checker are checked in one call."""

    def __init__(self):
        self.by_row: dict[int, StopChecker] = {}

    def first_stop(
        self, token_buffer: torch.Tensor, rows: np.ndarray, start_lens: np.ndarray, num_emitted: np.ndarray,
        max_lengths: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """`StopChecker.first_stop`, each row with its own checker."""
        keep, stopped = num_emitted.copy(), np.zeros(len(rows), dtype=bool)
        checkers = [self.by_row[int(row)] for row in rows]
        for checker in {id(c): c for c in checkers}.values():
            at = np.array([i for i, c in enumerate(checkers) if c is checker])
            keep[at], stopped[at] = checker.first_stop(
                token_buffer, rows[at], start_lens[at], num_emitted[at], None if max_lengths is None else max_lengths[at]
            )
        return keep, stopped
