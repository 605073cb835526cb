"""Block verification (`rejection_sample_method="block"`) in Triton, over a whole step's ragged drafts.

Same arguments and results as `hf_specdec.sampling.block_verification.block_verify_reference`,
whose docstring has the algorithm (Sun et al. 2024, arXiv 2403.10444, Algorithm 2) and its
numerics, and the same tokens given the same random draws. A step whose rows are all greedy is
token-wise's (`rejection_sample_triton`, identical by definition). Otherwise two launches, laid
out as the token-wise kernels (`hf_specdec.kernels.rejection`: `LaunchTiles`, (row, position)
pairs x vocabulary chunks, partial argmaxes reduced by the accept kernel):

1. `_block_position_kernel`: per (row, position) pair and vocabulary chunk,
   - greedy rows: the argmax of the logits (each draft is compared with it);
   - sampled rows with draft probabilities q: the pair's weight w_j (a scan over the drafts before
     it), then one pass over the chunk that both sums the residual mass
     Z_j = sum_x max(w_j p_j(x) - q_j(x), 0) (float64) and races the residual, rounded to
     float32, with the row's noise: argmax(max(w_j p_j - q_j, 0) / E) (p / E at the bonus
     position). Every position needs its mass for h, so every position races too: the race
     reuses the loads the mass makes, and the row's stop is known only once all masses are;
   - sampled rows with one-hot drafts: Z_j = w_j - w_j p_j(X_{j+1}) needs no vocabulary pass, so
     each pair runs the whole scan (weights, h, the stop tau: `_accepted_length`) and makes its
     vocabulary pass only at tau: the race over p_tau with X_{tau+1} zeroed, or p at the bonus.
2. `_block_accept_kernel`: per row, the scan again (the masses reduced from the chunks' partial
   sums), tau, the partial argmaxes reduced to the token at tau (greedy rows: the first draft
   unequal to the argmax, as token-wise), and the output row.

Operations match the reference one for one (float32 weights: `div_rn`, one multiply, one min;
float64 masses and h, where every product is of two float32 values, w * p, exact in float64 (the
one-hot mass is w - w * p for that reason), so the fused multiply-adds the compiler forms cannot
change them; only the masses' summation order differs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_specdec.kernels.rejection import LaunchTiles, StepTensors, rejection_sample_triton
from hf_specdec.sampling.metadata import SpecDecodeMetadata
from hf_specdec.sampling.rejection_reference import (
    NOISE_FLOOR,
    PLACEHOLDER_TOKEN_ID,
    RandomDraws,
)


@triton.jit
def _next_weight(weight, target_p, draft_q):
    """The reference's `next_weight`: min(w * (p(x) / q(x)), 1); q(x) = 0: 1 if w * p(x) > 0, else 0."""
    drawable = draft_q > 0
    ratio = tl.math.div_rn(target_p, tl.where(drawable, draft_q, 1.0))
    scaled = tl.minimum(weight * ratio, 1.0)
    return tl.where(drawable, scaled, tl.where(weight * target_p > 0, 1.0, 0.0))


@triton.jit
def _draft_probabilities(
    draft_index,
    mask,
    draft_ids_ptr,
    target_logits_indices_ptr,
    probs_ptr,
    probs_stride,
    draft_probs_ptr,
    draft_probs_stride,
    HAS_DRAFT_PROBS: tl.constexpr,
):
    """(p(x), q(x)) of the drafts at `draft_index`, float32; q(x) = 1 for one-hot drafts."""
    draft = tl.load(draft_ids_ptr + draft_index, mask=mask, other=0)
    logits_row = tl.load(target_logits_indices_ptr + draft_index, mask=mask, other=0)
    target_p = tl.load(probs_ptr + logits_row * probs_stride + draft, mask=mask, other=0.0).to(tl.float32)
    if HAS_DRAFT_PROBS:
        draft_q = tl.load(draft_probs_ptr + draft_index * draft_probs_stride + draft, mask=mask, other=1.0)
        draft_q = draft_q.to(tl.float32)
    else:
        draft_q = tl.zeros_like(target_p) + 1.0
    return target_p, draft_q


@triton.jit
def _accepted_length(
    row,
    draft_start,
    num_draft,
    sampled,
    max_spec_len,
    output_width,
    num_chunks,
    draft_ids_ptr,
    target_logits_indices_ptr,
    probs_ptr,
    probs_stride,
    draft_probs_ptr,
    draft_probs_stride,
    uniform_ptr,
    mass_ptr,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr,
):
    """tau per row (0 where `sampled` is False): the last i with eta_i < h_i.

    Walks the drafts once: at draft s (1 <= s < g) h_s = Z_s / (Z_s + 1 - w_s), Z_s from the
    position kernel's partial sums (q given) or w_s - w_s p_s(X_{s+1}) (one-hot); then w_{s+1};
    after the last draft h_g = w_g.
    """
    weight = tl.zeros_like(draft_start).to(tl.float32) + 1.0
    tau = tl.zeros_like(num_draft)
    for s in range(0, max_spec_len):
        valid = sampled & (s < num_draft)
        index = draft_start + s
        target_p, draft_q = _draft_probabilities(
            index,
            valid,
            draft_ids_ptr,
            target_logits_indices_ptr,
            probs_ptr,
            probs_stride,
            draft_probs_ptr,
            draft_probs_stride,
            HAS_DRAFT_PROBS,
        )
        has_h = valid & (index > draft_start)  # drafts 1..g-1 (0-based) carry h_s; vectors only in masks
        if HAS_DRAFT_PROBS:
            chunks = tl.arange(0, BLOCK_CHUNKS)[None, :]
            partial = ((row * output_width + s) * num_chunks)[:, None] + chunks
            partial_ok = has_h[:, None] & (chunks < num_chunks)
            mass = tl.sum(tl.load(mass_ptr + partial, mask=partial_ok, other=0.0), axis=1)
        else:
            # w - w * p, not w * (1 - p): the product is exact, so fusing it into an fma changes nothing
            weight_64 = weight.to(tl.float64)
            mass = weight_64 - weight_64 * target_p.to(tl.float64)
        denominator = mass + (1.0 - weight.to(tl.float64))
        positive = denominator > 0
        h = tl.where(positive, mass / tl.where(positive, denominator, 1.0), 0.0)
        eta = tl.load(uniform_ptr + index - 1, mask=has_h, other=1.0).to(tl.float64)
        tau = tl.where(has_h & (eta < h), s, tau)
        weight = tl.where(valid, _next_weight(weight, target_p, draft_q), weight)
        is_last = valid & (s + 1 == num_draft)
        eta_last = tl.load(uniform_ptr + index, mask=is_last, other=1.0)
        tau = tl.where(is_last & (eta_last < weight), s + 1, tau)
    return tau


@triton.jit
def _block_position_kernel(
    best_values_ptr,  # [rows, max_spec_len + 1, chunks] float32, written: each chunk's best value
    best_columns_ptr,  # [rows, max_spec_len + 1, chunks] int32, written: where it was first seen
    mass_ptr,  # [rows, max_spec_len + 1, chunks] float64, written when HAS_DRAFT_PROBS: partial Z_j
    logits_ptr,  # [total_draft + rows, vocab]
    logits_stride,
    probs_ptr,  # [total_draft + rows, vocab] softmax of logits
    probs_stride,
    draft_probs_ptr,  # [total_draft, vocab] q (read when HAS_DRAFT_PROBS only)
    draft_probs_stride,
    exponential_ptr,  # [rows, vocab] Exp(1) noise
    exponential_stride,
    uniform_ptr,  # [total_draft] eta, one per draft
    draft_ids_ptr,  # [total_draft]
    cu_num_draft_ptr,  # [rows] inclusive prefix sums of the draft counts
    target_logits_indices_ptr,  # [total_draft]
    bonus_logits_indices_ptr,  # [rows]
    is_greedy_ptr,  # [rows] bool
    num_rows,
    output_width,
    max_spec_len,
    vocab_size,
    chunk_columns,  # a multiple of BLOCK_V
    num_chunks,
    noise_floor,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_POSITIONS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr,
):
    pair = tl.arange(0, BLOCK_ROWS * BLOCK_POSITIONS)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + pair // BLOCK_POSITIONS
    position = tl.program_id(1) * BLOCK_POSITIONS + pair % BLOCK_POSITIONS
    row_ok = row < num_rows
    draft_end = tl.load(cu_num_draft_ptr + row, mask=row_ok, other=0)
    draft_start = tl.load(cu_num_draft_ptr + row - 1, mask=row_ok & (row > 0), other=0)
    num_draft = draft_end - draft_start
    active = row_ok & (position <= num_draft)
    at_draft = row_ok & (position < num_draft)
    draft_index = draft_start + position
    logits_row = tl.where(
        at_draft,
        tl.load(target_logits_indices_ptr + draft_index, mask=at_draft, other=0),
        tl.load(bonus_logits_indices_ptr + row, mask=row_ok, other=0),
    )
    greedy = tl.load(is_greedy_ptr + row, mask=row_ok, other=1) != 0
    sampled = row_ok & ~greedy
    draft = tl.load(draft_ids_ptr + draft_index, mask=at_draft, other=-1)  # -1 matches no column
    weight = tl.zeros_like(draft_start).to(tl.float32) + 1.0
    if HAS_DRAFT_PROBS:
        # w_j: the weights of the drafts before this position; the bonus position races p itself
        for s in range(0, max_spec_len):
            before = sampled & at_draft & (s < position)
            target_p, draft_q = _draft_probabilities(
                draft_start + s,
                before,
                draft_ids_ptr,
                target_logits_indices_ptr,
                probs_ptr,
                probs_stride,
                draft_probs_ptr,
                draft_probs_stride,
                HAS_DRAFT_PROBS,
            )
            weight = tl.where(before, _next_weight(weight, target_p, draft_q), weight)
    else:
        tau = _accepted_length(
            row,
            draft_start,
            num_draft,
            sampled,
            max_spec_len,
            output_width,
            num_chunks,
            draft_ids_ptr,
            target_logits_indices_ptr,
            probs_ptr,
            probs_stride,
            draft_probs_ptr,
            draft_probs_stride,
            uniform_ptr,
            mass_ptr,
            False,
            BLOCK_CHUNKS,
        )
        active = active & (greedy | (position == tau))
    logits_columns = tl.where(active & greedy, vocab_size, 0)[:, None]
    sampled_columns = tl.where(active & ~greedy, vocab_size, 0)[:, None]
    q_columns = tl.where(active & at_draft & ~greedy, vocab_size, 0)[:, None]
    logits_base = logits_ptr + logits_row[:, None] * logits_stride
    probs_base = probs_ptr + logits_row[:, None] * probs_stride
    q_base = draft_probs_ptr + draft_index[:, None] * draft_probs_stride
    noise_base = exponential_ptr + row[:, None] * exponential_stride
    weight_64 = weight.to(tl.float64)[:, None]

    if tl.max(active.to(tl.int32), axis=0) == 0:
        return

    chunk = tl.program_id(2)
    chunk_start = chunk * chunk_columns
    chunk_end = tl.minimum(chunk_start + chunk_columns, vocab_size)
    lanes = tl.arange(0, BLOCK_V)
    best_value = tl.full([BLOCK_ROWS * BLOCK_POSITIONS, BLOCK_V], float("-inf"), tl.float32)
    best_column = tl.zeros([BLOCK_ROWS * BLOCK_POSITIONS, BLOCK_V], tl.int32) + (chunk_start + lanes)[None, :]
    mass = tl.zeros([BLOCK_ROWS * BLOCK_POSITIONS, BLOCK_V], tl.float64)
    for block_start in range(chunk_start, chunk_end, BLOCK_V):
        columns = (block_start + lanes)[None, :]
        logit = tl.load(logits_base + columns, mask=columns < logits_columns, other=float("-inf")).to(
            tl.float32
        )
        prob = tl.load(probs_base + columns, mask=columns < sampled_columns, other=0.0).to(tl.float32)
        if HAS_DRAFT_PROBS:
            q = tl.load(q_base + columns, mask=columns < q_columns, other=0.0).to(tl.float32)
            # exact in float64 (a product of two float32), so a fused multiply-add rounds it alike
            residual = tl.maximum(weight_64 * prob.to(tl.float64) - q.to(tl.float64), 0.0)
            mass += residual
            race_weight = residual.to(tl.float32)
        else:
            race_weight = tl.where(columns == draft[:, None], 0.0, prob)
        noise = tl.load(noise_base + columns, mask=columns < sampled_columns, other=1.0).to(tl.float32)
        race = tl.where(
            columns < sampled_columns,
            tl.math.div_rn(race_weight, tl.maximum(noise, noise_floor)),
            float("-inf"),
        )
        value = tl.where(greedy[:, None], logit, race)
        better = value > best_value  # strict: on a tie the earlier column stays
        best_value = tl.where(better, value, best_value)
        best_column = tl.where(better, columns, best_column)

    chunk_max = tl.max(best_value, axis=1)
    chunk_argmax = tl.min(tl.where(best_value == chunk_max[:, None], best_column, vocab_size), axis=1)
    partial = (row * output_width + position) * num_chunks + chunk
    tl.store(best_values_ptr + partial, chunk_max, mask=active)
    tl.store(best_columns_ptr + partial, chunk_argmax, mask=active)
    if HAS_DRAFT_PROBS:
        tl.store(mass_ptr + partial, tl.sum(mass, axis=1), mask=active & ~greedy)


@triton.jit
def _block_accept_kernel(
    output_ptr,  # [rows, max_spec_len + 1] int64, written
    output_stride,
    num_accepted_ptr,  # [rows] int64, written
    best_values_ptr,  # [rows, max_spec_len + 1, chunks] from _block_position_kernel
    best_columns_ptr,
    mass_ptr,
    probs_ptr,
    probs_stride,
    draft_probs_ptr,
    draft_probs_stride,
    uniform_ptr,
    draft_ids_ptr,
    cu_num_draft_ptr,
    target_logits_indices_ptr,
    is_greedy_ptr,
    num_rows,
    output_width,
    max_spec_len,
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
    row_greedy = tl.load(is_greedy_ptr + row, mask=row_ok, other=1) != 0
    tau = _accepted_length(
        row,
        draft_start,
        row_drafts,
        row_ok & ~row_greedy,
        max_spec_len,
        output_width,
        num_chunks,
        draft_ids_ptr,
        target_logits_indices_ptr,
        probs_ptr,
        probs_stride,
        draft_probs_ptr,
        draft_probs_stride,
        uniform_ptr,
        mass_ptr,
        HAS_DRAFT_PROBS,
        BLOCK_CHUNKS,
    )

    tokens_in_row = tl.where(row_ok, row_drafts + 1, 0)[:, None]  # drafts + the bonus position
    num_draft = row_drafts[:, None]
    greedy = row_greedy[:, None]
    positions = tl.arange(0, BLOCK_SPEC)[None, :]
    is_draft = positions < num_draft
    drafts = tl.load(draft_ids_ptr + draft_start[:, None] + positions, mask=is_draft, other=PLACEHOLDER)
    # where the position kernel ran: every position of greedy rows and of rows with q, tau of the others
    computed = positions < tokens_in_row
    if not HAS_DRAFT_PROBS:
        computed = computed & (greedy | (positions == tau[:, None]))

    chunks = tl.arange(0, BLOCK_CHUNKS)[None, None, :]
    partial = ((row[:, None] * output_width + positions) * num_chunks)[:, :, None] + chunks
    partial_ok = computed[:, :, None] & (chunks < num_chunks)
    chunk_best = tl.load(best_values_ptr + partial, mask=partial_ok, other=float("-inf"))
    chunk_column = tl.load(best_columns_ptr + partial, mask=partial_ok, other=2147483647)
    best = tl.max(chunk_best, axis=2)
    position_tokens = tl.min(tl.where(chunk_best == best[:, :, None], chunk_column, 2147483647), axis=2)

    greedy_accepted = tl.min(tl.where(is_draft & (drafts != position_tokens), positions, num_draft), axis=1)
    num_accepted = tl.where(row_greedy, greedy_accepted, tau)
    accepted = num_accepted[:, None]
    tokens = tl.where(
        positions < accepted,
        drafts,
        tl.where(positions == accepted, position_tokens, PLACEHOLDER),
    )
    output_columns = tl.where(row_ok, output_width, 0)[:, None]
    tl.store(output_ptr + row[:, None] * output_stride + positions, tokens, mask=positions < output_columns)
    tl.store(num_accepted_ptr + row, num_accepted, mask=row_ok)


def block_verify_triton(
    metadata: SpecDecodeMetadata,
    logits: torch.Tensor,
    is_greedy: torch.Tensor,
    draws: RandomDraws | None = None,
    draft_probs: torch.Tensor | None = None,
    *,
    tiles: LaunchTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_verify_reference` on the Triton kernels: same arguments, same results.

    Tensors on a CUDA device, or on CPU under TRITON_INTERPRET=1 (as `rejection_sample_triton`);
    `tiles` overrides `LaunchTiles.choose` (tests run the GPU's tiles under the interpreter).
    """
    step = StepTensors.prepare(metadata, logits, is_greedy, draws, draft_probs, tiles)
    if step.all_greedy:  # every row greedy: token-wise's rule is the rule
        return rejection_sample_triton(metadata, logits, is_greedy, tiles=tiles)
    num_rows, output_width = metadata.num_rows, metadata.max_spec_len + 1
    device, tiles, num_chunks, has_draft_probs = step.logits.device, step.tiles, step.num_chunks, step.has_draft_probs
    logits, is_greedy, probs, draft_probs = step.logits, step.is_greedy, step.probs, step.draft_probs
    output = torch.empty((num_rows, output_width), dtype=torch.int64, device=device)
    num_accepted = torch.empty(num_rows, dtype=torch.int64, device=device)
    block_chunks = triton.next_power_of_2(num_chunks)
    block_spec = triton.next_power_of_2(output_width)

    best_values = torch.empty((num_rows, output_width, num_chunks), dtype=torch.float32, device=device)
    best_columns = torch.empty((num_rows, output_width, num_chunks), dtype=torch.int32, device=device)
    # partial residual masses; a stand-in pointer for one-hot drafts, which have closed-form masses
    mass_shape = (num_rows, output_width, num_chunks) if has_draft_probs else (1,)
    mass = torch.empty(mass_shape, dtype=torch.float64, device=device)
    position_grid = (
        triton.cdiv(num_rows, tiles.rows),
        triton.cdiv(output_width, tiles.positions),
        num_chunks,
    )
    _block_position_kernel[position_grid](
        best_values,
        best_columns,
        mass,
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
        metadata.max_spec_len,
        step.vocab_size,
        step.chunk_columns,
        num_chunks,
        NOISE_FLOOR,
        HAS_DRAFT_PROBS=has_draft_probs,
        BLOCK_ROWS=tiles.rows,
        BLOCK_POSITIONS=tiles.positions,
        BLOCK_V=tiles.vocab,
        BLOCK_CHUNKS=block_chunks,
        num_warps=tiles.warps,
    )
    _block_accept_kernel[(triton.cdiv(num_rows, tiles.accept_rows),)](
        output,
        output.stride(0),
        num_accepted,
        best_values,
        best_columns,
        mass,
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
        metadata.max_spec_len,
        num_chunks,
        HAS_DRAFT_PROBS=has_draft_probs,
        PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
        BLOCK_ROWS=tiles.accept_rows,
        BLOCK_SPEC=block_spec,
        BLOCK_CHUNKS=block_chunks,
        num_warps=4,
    )
    return output, num_accepted
