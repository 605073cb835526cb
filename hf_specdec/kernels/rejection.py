"""Rejection sampling (seed §12.2) in Triton, over a whole step's ragged drafts at once.

Same arguments and results as `hf_specdec.sampling.rejection_sampler.rejection_sample_reference`, and the
same tokens given the same random draws. Two launches:

1. `_position_tokens_kernel`: for every (row, position), position = 0..num_draft, the token the
   row emits if its accepted run stops at that position, as a partial argmax over one chunk of
   the vocabulary per program (the (value, first column) of the chunk's best).
   - greedy rows: the argmax of the logits there (also what the draft there is compared with);
   - sampled rows: the exponential race argmax(w / E) over the row's one noise vector E, with
     w = max(p - q, 0) at a draft position (p with the draft zeroed when q is one-hot), w = p at
     the bonus position.
   A greedy row needs the argmax at every position (each draft is compared with it), so rows x
   positions programs share those vocabulary passes where a per-row loop would make one program
   read num_draft + 1 full rows. A sampled row needs its token only where its accepted run stops;
   its drafts' tests are scalars (u * q(x) < p(x)), so each (row, position) program runs them up
   to its own position and makes the vocabulary pass only at the stop.
2. `_accept_kernel`: per row, tests all of its drafts at once (at most 32: greedy draft ==
   argmax, sampled u * q(x) < p(x)), takes the first failing position as the accepted length,
   reduces the chunks' partial argmaxes to the token there, and writes the output row: accepted
   drafts, that token, -1 padding.

Each program handles a tile of (row, position) pairs and one vocabulary chunk; `LaunchTiles`
sets their sizes. On a GPU a position-token program takes one pair, and when there are few pairs
(small batches, few drafts) the vocabulary is split into chunks so that enough programs run to
fill the SMs: one program streaming a 150k vocabulary alone is latency-bound. Triton's
interpreter pays per program and per operation, not per element, so there a program takes many
pairs and the whole vocabulary. Greedy and sampled rows share a tile: each side's loads are
masked off for the other. A step whose rows are all greedy (the common case) compiles a loop
without the race's loads and divisions (`ALL_GREEDY`): on an H200 that made the greedy launch for
256 rows x 9 positions of a 150k vocabulary 2.7x faster than the shared loop.

p comes from `target_probabilities`, the torch softmax the reference reads too: a softmax
recomputed here would sum in another order, move p by an ulp and now and then flip a token.
Quotients use IEEE round-to-nearest division (`div_rn`) because Triton's `/` on float32 may be
approximate on GPU while torch divides exactly. Argmaxes return the first index of the maximum,
as torch's; NaN logits are the one input where they differ (torch returns the NaN's index).
Masks are built as `column < limit` with a per-pair limit (0 = read nothing) rather than
`vector & scalar`, which Triton's interpreter turns into an int32 mask it then refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hf_specdec.sampling.metadata import SpecDecodeMetadata
from hf_specdec.sampling.rejection_reference import (
    NOISE_FLOOR,
    PLACEHOLDER_TOKEN_ID,
    RandomDraws,
    target_probabilities,
)

MAX_SPEC_LEN = 32  # drafts per row the accept kernel takes in one vector (SpeculativeConfig's k limit)
GPU_VOCAB_BLOCK = 2048  # vocabulary columns a GPU position-token program reads per loop iteration
GPU_ACCEPT_ROWS = 16  # rows per GPU accept program: each row is a few scalars per draft
GPU_POSITION_WARPS = 8  # warps per GPU position-token program (4 took up to 30% longer on an H200)
GPU_TARGET_PROGRAMS = 1024  # position-token programs worth launching: several per SM of an H100 / H200
GPU_MAX_VOCAB_SPLITS = 64  # chunks per pair at most (the accept kernel reduces them in registers)
GPU_ACCEPT_TILE = 4096  # partial results an accept program holds (rows x positions x chunks)
INTERPRETER_PAIRS = 256  # (row, position) pairs per interpreted program
INTERPRETER_TILE = 1 << 17  # elements per interpreted tile (pairs x vocabulary block)


@dataclass(frozen=True)
class LaunchTiles:
    """How much work one program takes (rows, positions, vocab and accept_rows are powers of two)."""

    rows: int  # rows per position-token program
    positions: int  # positions per position-token program
    vocab: int  # vocabulary columns per position-token loop iteration
    accept_rows: int  # rows per accept program
    vocab_splits: int = 1  # vocabulary chunks per (row, position) pair, each its own program
    warps: int = 4  # warps per position-token program

    @classmethod
    def choose(cls, num_rows: int, output_width: int, vocab_size: int, interpreted: bool) -> LaunchTiles:
        """On a GPU one pair per program, the vocabulary split until about GPU_TARGET_PROGRAMS
        programs run; under the interpreter, whole rows, as many as fit, and no split."""
        if not interpreted:
            vocab = min(triton.next_power_of_2(vocab_size), GPU_VOCAB_BLOCK)
            wanted_splits = triton.cdiv(GPU_TARGET_PROGRAMS, num_rows * output_width)
            vocab_splits = max(1, min(wanted_splits, triton.cdiv(vocab_size, vocab), GPU_MAX_VOCAB_SPLITS))
            spec_block = triton.next_power_of_2(output_width) * triton.next_power_of_2(vocab_splits)
            accept_rows = max(1, min(GPU_ACCEPT_ROWS, GPU_ACCEPT_TILE // spec_block))
            return cls(
                rows=1,
                positions=1,
                vocab=vocab,
                accept_rows=accept_rows,
                vocab_splits=vocab_splits,
                warps=GPU_POSITION_WARPS,
            )
        positions = triton.next_power_of_2(output_width)
        rows = min(triton.next_power_of_2(num_rows), max(1, INTERPRETER_PAIRS // positions))
        vocab = min(triton.next_power_of_2(vocab_size), max(16, INTERPRETER_TILE // (rows * positions)))
        return cls(rows=rows, positions=positions, vocab=vocab, accept_rows=triton.next_power_of_2(num_rows))

    def vocab_chunks(self, vocab_size: int) -> tuple[int, int]:
        """(columns per chunk, number of chunks): whole loop iterations per chunk, no empty chunk."""
        chunk_columns = triton.cdiv(triton.cdiv(vocab_size, self.vocab_splits), self.vocab) * self.vocab
        return chunk_columns, triton.cdiv(vocab_size, chunk_columns)


@triton.jit
def _sampled_draft_passes(
    draft_index,
    drafts,
    mask,
    probs_ptr,
    probs_stride,
    draft_probs_ptr,
    draft_probs_stride,
    uniform_ptr,
    target_logits_indices_ptr,
    HAS_DRAFT_PROBS: tl.constexpr,
):
    """The reference's test of a sampled row's draft x: u * q(x) < p(x), q(x) = 1 for one-hot drafts
    (False where masked)."""
    logits_rows = tl.load(target_logits_indices_ptr + draft_index, mask=mask, other=0)
    target_p = tl.load(probs_ptr + logits_rows * probs_stride + drafts, mask=mask, other=0.0)
    uniform = tl.load(uniform_ptr + draft_index, mask=mask, other=1.0)
    draft_q = 1.0
    if HAS_DRAFT_PROBS:
        draft_q = tl.load(draft_probs_ptr + draft_index * draft_probs_stride + drafts, mask=mask, other=1.0)
    return uniform * draft_q < target_p


@triton.jit
def _position_tokens_kernel(
    best_values_ptr,  # [rows, max_spec_len + 1, chunks] float32, written: each chunk's best value
    best_columns_ptr,  # [rows, max_spec_len + 1, chunks] int32, written: where it was first seen
    logits_ptr,  # [total_draft + rows, vocab]
    logits_stride,
    probs_ptr,  # [total_draft + rows, vocab] softmax of logits (read for sampled rows only)
    probs_stride,
    draft_probs_ptr,  # [total_draft, vocab] q (read when HAS_DRAFT_PROBS only)
    draft_probs_stride,
    exponential_ptr,  # [rows, vocab] Exp(1) noise (read for sampled rows only)
    exponential_stride,
    uniform_ptr,  # [total_draft] U[0, 1), one per draft (read for sampled rows only)
    draft_ids_ptr,  # [total_draft]
    cu_num_draft_ptr,  # [rows] inclusive prefix sums of the draft counts
    target_logits_indices_ptr,  # [total_draft]
    bonus_logits_indices_ptr,  # [rows]
    is_greedy_ptr,  # [rows] bool
    num_rows,
    output_width,
    vocab_size,
    chunk_columns,  # a multiple of BLOCK_V
    noise_floor,
    ALL_GREEDY: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_POSITIONS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_SPEC: tl.constexpr,
):
    # the program's (row, position) pairs, flattened; a pair's vectors below are indexed alike
    pair = tl.arange(0, BLOCK_ROWS * BLOCK_POSITIONS)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + pair // BLOCK_POSITIONS
    position = tl.program_id(1) * BLOCK_POSITIONS + pair % BLOCK_POSITIONS
    row_ok = row < num_rows
    draft_end = tl.load(cu_num_draft_ptr + row, mask=row_ok, other=0)
    draft_start = tl.load(cu_num_draft_ptr + row - 1, mask=row_ok & (row > 0), other=0)
    num_draft = draft_end - draft_start
    active = row_ok & (position <= num_draft)  # the grid is as wide as the longest row
    at_draft = row_ok & (position < num_draft)
    draft_index = draft_start + position  # the draft verified at this position (none at the bonus)
    logits_row = tl.where(
        at_draft,
        tl.load(target_logits_indices_ptr + draft_index, mask=at_draft, other=0),
        tl.load(bonus_logits_indices_ptr + row, mask=row_ok, other=0),
    )
    greedy = tl.load(is_greedy_ptr + row, mask=row_ok, other=1) != 0
    draft = tl.load(draft_ids_ptr + draft_index, mask=at_draft, other=-1)  # -1 matches no column
    if not ALL_GREEDY:
        # a sampled row's token is needed only where its accepted run stops: the first failing draft,
        # or the bonus position. Its drafts' tests are scalars, so each pair runs them up to its own
        # position and skips the vocabulary pass elsewhere (k of k + 1 positions when k are drafted).
        spec = tl.arange(0, BLOCK_SPEC)[None, :]
        tested = (spec <= position[:, None]) & (spec < num_draft[:, None]) & (row_ok & ~greedy)[:, None]
        tested_index = draft_start[:, None] + spec
        tested_drafts = tl.load(draft_ids_ptr + tested_index, mask=tested, other=0)
        passes = _sampled_draft_passes(
            tested_index,
            tested_drafts,
            tested,
            probs_ptr,
            probs_stride,
            draft_probs_ptr,
            draft_probs_stride,
            uniform_ptr,
            target_logits_indices_ptr,
            HAS_DRAFT_PROBS,
        )
        first_failure = tl.min(tl.where(tested & ~passes, spec, BLOCK_SPEC), axis=1)
        stops_here = (first_failure == position) | ((first_failure == BLOCK_SPEC) & (position == num_draft))
        active = active & (greedy | stops_here)
    # columns each pair reads: the logits for greedy pairs, p and E for sampled ones, q at sampled
    # draft positions only (at the bonus position q loads as 0, and max(p - 0, 0) is p exactly)
    logits_columns = tl.where(active & greedy, vocab_size, 0)[:, None]
    sampled_columns = tl.where(active & ~greedy, vocab_size, 0)[:, None]
    q_columns = tl.where(at_draft & ~greedy, vocab_size, 0)[:, None]
    logits_base = logits_ptr + logits_row[:, None] * logits_stride
    probs_base = probs_ptr + logits_row[:, None] * probs_stride
    q_base = draft_probs_ptr + draft_index[:, None] * draft_probs_stride
    noise_base = exponential_ptr + row[:, None] * exponential_stride

    if tl.max(active.to(tl.int32), axis=0) == 0:  # past every row's end: rows draft fewer than the longest
        return

    # per pair and lane: the best value of the chunk's columns lane, lane + BLOCK_V, ... and where
    # it was first seen
    chunk = tl.program_id(2)
    chunk_start = chunk * chunk_columns
    chunk_end = tl.minimum(chunk_start + chunk_columns, vocab_size)
    lanes = tl.arange(0, BLOCK_V)
    best_value = tl.full([BLOCK_ROWS * BLOCK_POSITIONS, BLOCK_V], float("-inf"), tl.float32)
    best_column = tl.zeros([BLOCK_ROWS * BLOCK_POSITIONS, BLOCK_V], tl.int32) + (chunk_start + lanes)[None, :]
    for block_start in range(chunk_start, chunk_end, BLOCK_V):
        columns = (block_start + lanes)[None, :]
        logit = tl.load(logits_base + columns, mask=columns < logits_columns, other=float("-inf"))
        if ALL_GREEDY:  # the common case gets a loop without the race's loads and divisions
            value = logit.to(tl.float32)
        else:
            weight = tl.load(probs_base + columns, mask=columns < sampled_columns, other=0.0).to(tl.float32)
            if HAS_DRAFT_PROBS:
                q = tl.load(q_base + columns, mask=columns < q_columns, other=0.0).to(tl.float32)
                weight = tl.maximum(weight - q, 0.0)
            else:
                weight = tl.where(columns == draft[:, None], 0.0, weight)
            noise = tl.load(noise_base + columns, mask=columns < sampled_columns, other=1.0).to(tl.float32)
            race = tl.where(
                columns < sampled_columns,
                tl.math.div_rn(weight, tl.maximum(noise, noise_floor)),
                float("-inf"),
            )
            value = tl.where(greedy[:, None], logit.to(tl.float32), race)
        better = value > best_value  # strict: on a tie the earlier column stays
        best_value = tl.where(better, value, best_value)
        best_column = tl.where(better, columns, best_column)

    # the first column holding the chunk's maximum is the smallest first-seen column among its best lanes
    chunk_max = tl.max(best_value, axis=1)
    chunk_argmax = tl.min(tl.where(best_value == chunk_max[:, None], best_column, vocab_size), axis=1)
    partial = (row * output_width + position) * tl.num_programs(2) + chunk
    tl.store(best_values_ptr + partial, chunk_max, mask=active)
    tl.store(best_columns_ptr + partial, chunk_argmax, mask=active)


@triton.jit
def _accept_kernel(
    output_ptr,  # [rows, max_spec_len + 1] int64, written
    output_stride,
    num_accepted_ptr,  # [rows] int64, written
    best_values_ptr,  # [rows, max_spec_len + 1, chunks] from _position_tokens_kernel
    best_columns_ptr,
    probs_ptr,
    probs_stride,
    draft_probs_ptr,
    draft_probs_stride,
    uniform_ptr,  # [total_draft] U[0, 1), one per draft (read for sampled rows only)
    draft_ids_ptr,
    cu_num_draft_ptr,
    target_logits_indices_ptr,
    is_greedy_ptr,
    num_rows,
    output_width,
    num_chunks,
    HAS_DRAFT_PROBS: tl.constexpr,
    PLACEHOLDER: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_SPEC: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = row < num_rows
    draft_end = tl.load(cu_num_draft_ptr + row, mask=row_ok, other=0)
    draft_start = tl.load(cu_num_draft_ptr + row - 1, mask=row_ok & (row > 0), other=0)
    row_drafts = draft_end - draft_start
    tokens_in_row = tl.where(row_ok, row_drafts + 1, 0)[:, None]  # drafts + the bonus position
    num_draft = row_drafts[:, None]
    greedy = (tl.load(is_greedy_ptr + row, mask=row_ok, other=1) != 0)[:, None]
    positions = tl.arange(0, BLOCK_SPEC)[None, :]
    is_draft = positions < num_draft
    draft_index = draft_start[:, None] + positions
    drafts = tl.load(draft_ids_ptr + draft_index, mask=is_draft, other=PLACEHOLDER)

    sampled_passes = _sampled_draft_passes(
        draft_index,
        drafts,
        is_draft & ~greedy,
        probs_ptr,
        probs_stride,
        draft_probs_ptr,
        draft_probs_stride,
        uniform_ptr,
        target_logits_indices_ptr,
        HAS_DRAFT_PROBS,
    )
    # where the position-token kernel ran: every position of a greedy row, the stop of a sampled one
    sampled_stop = tl.min(tl.where(is_draft & ~sampled_passes, positions, num_draft), axis=1)[:, None]
    computed = (positions < tokens_in_row) & (greedy | (positions == sampled_stop))

    # position tokens: the best of the chunks' bests, on a tie the first column (chunks are in order)
    chunks = tl.arange(0, BLOCK_CHUNKS)[None, None, :]
    partial = ((row[:, None] * output_width + positions) * num_chunks)[:, :, None] + chunks
    partial_ok = computed[:, :, None] & (chunks < num_chunks)
    chunk_best = tl.load(best_values_ptr + partial, mask=partial_ok, other=float("-inf"))
    chunk_column = tl.load(best_columns_ptr + partial, mask=partial_ok, other=2147483647)
    best = tl.max(chunk_best, axis=2)
    position_tokens = tl.min(tl.where(chunk_best == best[:, :, None], chunk_column, 2147483647), axis=2)
    passes = tl.where(greedy, drafts == position_tokens, sampled_passes)

    num_accepted = tl.min(tl.where(is_draft & ~passes, positions, num_draft), axis=1)
    accepted = num_accepted[:, None]
    tokens = tl.where(
        positions < accepted,
        drafts,
        tl.where(positions == accepted, position_tokens, PLACEHOLDER),
    )
    output_columns = tl.where(row_ok, output_width, 0)[:, None]
    tl.store(output_ptr + row[:, None] * output_stride + positions, tokens, mask=positions < output_columns)
    tl.store(num_accepted_ptr + row, num_accepted, mask=row_ok)


def kernels_are_interpreted() -> bool:
    """True when triton was imported under TRITON_INTERPRET=1: the kernels then run on CPU tensors.

    Triton decorates its own library functions (`tl.max`, ...) as it is imported, so the variable
    must be set before triton is first imported, not merely before this module.
    """
    return not isinstance(_accept_kernel, triton.runtime.JITFunction) and not isinstance(
        tl.max, triton.runtime.JITFunction
    )


def _non_empty(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor, or one zero of its dtype when it is empty (a step without drafts).

    An empty tensor's data pointer may be null, which a kernel launch may refuse; the kernels
    read nothing of a per-draft tensor when there are no drafts.
    """
    if tensor.numel():
        return tensor
    return torch.zeros((1,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)


@dataclass
class StepTensors:
    """One step's tensors as both samplers' kernels read them (`rejection_sample_triton`,
    `block_verify_triton`), on the logits' device, after the checks both make. A tensor no program
    reads (p and the noise when every row is greedy, q for one-hot drafts) still needs a valid
    pointer argument: logits stands in."""

    logits: torch.Tensor  # contiguous
    is_greedy: torch.Tensor  # [rows] bool
    probs: torch.Tensor  # the target's p (`target_probabilities`); logits when every row is greedy
    all_greedy: bool
    uniform: torch.Tensor
    exponential: torch.Tensor
    draft_probs: torch.Tensor  # q; logits for one-hot drafts
    has_draft_probs: bool
    draft_ids: torch.Tensor
    cu_num_draft: torch.Tensor
    target_logits_indices: torch.Tensor
    bonus_logits_indices: torch.Tensor
    vocab_size: int
    tiles: LaunchTiles
    chunk_columns: int
    num_chunks: int

    @classmethod
    def prepare(
        cls,
        metadata: SpecDecodeMetadata,
        logits: torch.Tensor,
        is_greedy: torch.Tensor,
        draws: RandomDraws | None,
        draft_probs: torch.Tensor | None,
        tiles: LaunchTiles | None,
    ) -> StepTensors:
        if metadata.max_spec_len > MAX_SPEC_LEN:
            raise ValueError(
                f"the Triton rejection sampler takes at most {MAX_SPEC_LEN} drafts per row, "
                f"got {metadata.max_spec_len}"
            )
        device = logits.device
        interpreted = kernels_are_interpreted()
        if device.type != "cuda" and not interpreted:
            raise ValueError(
                f"the Triton rejection sampler got {device.type} tensors; CPU tensors need TRITON_INTERPRET=1 "
                "set before hf_specdec.kernels is first imported"
            )
        num_rows, output_width, vocab_size = metadata.num_rows, metadata.max_spec_len + 1, logits.shape[-1]
        logits = logits.contiguous()
        is_greedy = is_greedy.to(device=device, dtype=torch.bool).contiguous()
        probs = target_probabilities(logits, is_greedy) if num_rows else None
        if probs is not None and draws is None:
            raise ValueError("rejection_sample needs random draws for sampled rows")
        tiles = tiles or LaunchTiles.choose(max(num_rows, 1), output_width, vocab_size, interpreted)
        chunk_columns, num_chunks = tiles.vocab_chunks(vocab_size)
        return cls(
            logits=logits,
            is_greedy=is_greedy,
            probs=logits if probs is None else probs,
            all_greedy=probs is None,
            uniform=logits if draws is None else _non_empty(draws.uniform.to(device).contiguous()),
            exponential=logits if draws is None else draws.exponential.to(device).contiguous(),
            draft_probs=logits if draft_probs is None else _non_empty(draft_probs.to(device).contiguous()),
            has_draft_probs=draft_probs is not None,
            draft_ids=_non_empty(metadata.draft_token_ids.to(device)),
            cu_num_draft=metadata.cu_num_draft_tokens.to(device),
            target_logits_indices=_non_empty(metadata.target_logits_indices.to(device)),
            bonus_logits_indices=metadata.bonus_logits_indices.to(device),
            vocab_size=vocab_size,
            tiles=tiles,
            chunk_columns=chunk_columns,
            num_chunks=num_chunks,
        )


def rejection_sample_triton(
    metadata: SpecDecodeMetadata,
    logits: torch.Tensor,
    is_greedy: torch.Tensor,
    draws: RandomDraws | None = None,
    draft_probs: torch.Tensor | None = None,
    *,
    tiles: LaunchTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample_reference` on the Triton kernels: same arguments, same results.

    Tensors must be on a CUDA device, or on CPU when this module was imported under
    TRITON_INTERPRET=1 (the tests' way of running the kernels without a GPU). `tiles` overrides
    `LaunchTiles.choose` (tests run the GPU's tiles under the interpreter with it).
    """
    num_rows, output_width = metadata.num_rows, metadata.max_spec_len + 1
    step = StepTensors.prepare(metadata, logits, is_greedy, draws, draft_probs, tiles)
    device, tiles, num_chunks = step.logits.device, step.tiles, step.num_chunks
    # the accept kernel writes every column of every row, padding included
    output = torch.empty((num_rows, output_width), dtype=torch.int64, device=device)
    num_accepted = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return output, num_accepted
    logits, is_greedy, probs, draft_probs = step.logits, step.is_greedy, step.probs, step.draft_probs

    best_values = torch.empty((num_rows, output_width, num_chunks), dtype=torch.float32, device=device)
    best_columns = torch.empty((num_rows, output_width, num_chunks), dtype=torch.int32, device=device)
    position_grid = (
        triton.cdiv(num_rows, tiles.rows),
        triton.cdiv(output_width, tiles.positions),
        num_chunks,
    )
    _position_tokens_kernel[position_grid](
        best_values,
        best_columns,
        logits,
        logits.stride(0),
        probs,
        probs.stride(0),
        draft_probs,
        draft_probs.stride(0),
        step.exponential,
        step.exponential.stride(0),
        step.uniform,
        step.draft_ids,
        step.cu_num_draft,
        step.target_logits_indices,
        step.bonus_logits_indices,
        is_greedy,
        num_rows,
        output_width,
        step.vocab_size,
        step.chunk_columns,
        NOISE_FLOOR,
        ALL_GREEDY=step.all_greedy,
        HAS_DRAFT_PROBS=step.has_draft_probs,
        BLOCK_ROWS=tiles.rows,
        BLOCK_POSITIONS=tiles.positions,
        BLOCK_V=tiles.vocab,
        BLOCK_SPEC=triton.next_power_of_2(output_width),
        num_warps=tiles.warps,
    )
    _accept_kernel[(triton.cdiv(num_rows, tiles.accept_rows),)](
        output,
        output.stride(0),
        num_accepted,
        best_values,
        best_columns,
        probs,
        probs.stride(0),
        draft_probs,
        draft_probs.stride(0),
        step.uniform,
        step.draft_ids,
        step.cu_num_draft,
        step.target_logits_indices,
        is_greedy,
        num_rows,
        output_width,
        num_chunks,
        HAS_DRAFT_PROBS=step.has_draft_probs,
        PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
        BLOCK_ROWS=tiles.accept_rows,
        BLOCK_SPEC=triton.next_power_of_2(output_width),
        BLOCK_CHUNKS=triton.next_power_of_2(num_chunks),
        num_warps=4,
    )
    return output, num_accepted
