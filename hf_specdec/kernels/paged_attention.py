"""Paged varlen attention in Triton: every row's new tokens against the keys / values its block
table points to, read in place from the paged KV pool (`hf_specdec.cache.paged_cache`).

What it computes, per row r with q_len new tokens (packed in `query` row after row, from
`query_start_loc[r]`) and seq_len keys (`seq_lens[r]`, the new tokens' own keys being the last
q_len): query i sits at slot p = seq_len - q_len + i, key j at pool slot
`block_table[r, j // block_size] * block_size + j % block_size`, and

    out[i, h] = sum_j softmax_j(s_ij) v_j,   s_ij = cap(q_i . k_j * scale) over the visible j

with cap(s) = tanh(s / softcap) * softcap when `softcap` is given (Gemma 2), and, with `sinks`
(gpt-oss), one extra logit per head in the softmax's denominator that has no value. Visible: j <= p
(causal) and p - j < window when `window` is set; `tree_mask` `[rows, >= max_query_len, T]`
(draft trees) replaces causality over each row's last T keys, key seq_len - T + t being visible to
new token i iff tree_mask[r, i, t] (T >= q_len: the new tokens and possibly keys before them, such
as a drafter's own earlier tree entries; keys before those stay visible, and the window still
applies on slots); a dense `mask` replaces all of that. A query that sees no key at all (only possible with `mask`) gets zeros. Query head h reads
kv head h // (num_heads // num_kv_heads) (GQA / MQA). This is what `_explicit_attention` and SDPA
compute on the gathered rows in `hf_specdec.cache.paged_attention`, without the gather.

Layout: `query [tokens, heads, head_dim]`, pools `[blocks, block_size, kv_heads, head_dim(_v)]`
(any strides), `out [tokens, heads, head_dim_v]`. Block sizes need not be powers of two: every key
computes its own slot, a tile of `AttentionTiles.keys` keys at a time.

Why our own kernel: flash-attn's varlen kernel takes a block table only for block_size % 256 == 0
(our pools use 16-token blocks) and has no tree mask and no sinks; the Hub `kernels` builds are
CUDA-only binaries. Triton's interpreter also runs this one on CPU tensors, which is how the tests
check it without a GPU.

Kernel layout (flash-attention style, written for this cache):
- a program takes one row's tile of `AttentionTiles.queries` new tokens times all query heads of
  one kv head group, so its M = tokens x group heads queries share every K / V tile it loads (GQA
  packing: K / V are read once per group, and decode rows with one token still fill M with heads);
- it walks the row's keys in tiles through the block table with an online softmax in float32
  (scores in the log2 domain, `exp2`), and skips the tiles no query of its tile can see: before the
  window of its first token, after the last token's causal limit (with `mask` every key up to
  seq_len is read, the mask deciding);
- split-KV (flash-decoding): with few rows and long contexts, each program's key range is cut into
  `num_splits` parts, each its own program, that write a partial output and its log-sum-exp; a
  second kernel (`_combine_splits_kernel`) merges them, adding the sinks' terms to the denominator.
  With one split the first kernel writes the output itself (the sinks seed its running max / sum).

How splits are chosen (`choose_num_splits`, from host-known sizes only): the grid without splitting
has rows x query tiles x kv heads programs. When that reaches GPU_TARGET_PROGRAMS_PER_SM per SM,
there is no split (and max_seq_len is not needed). Otherwise the split count grows to fill the GPU,
each split keeping at least MIN_KEY_TILES_PER_SPLIT key tiles of the longest row (so a split
amortises its partial store and the combine), at most MAX_SPLITS. The interpreter runs one split
unless told otherwise (it pays per program). `num_splits=` forces a count (the tests compare them).

No host sync happens inside `paged_attention` when `max_seq_len` is given (it is read with one sync
only when needed for the split decision), and nothing loops over rows in Python; tokens past
`query_start_loc[-1]`, or past a row's first `max_query_len`, are left unwritten.

float32 scores use IEEE products (`input_precision="ieee"`) so that fp32 matches PyTorch closely;
bf16 / fp16 use the tensor cores with float32 accumulation, the probabilities cast to the value
dtype for the second product, as flash-attention does.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# log2(e): scores are kept in the log2 domain (exp2 is the hardware's exponential)
LOG2E = tl.constexpr(1.4426950408889634)

GPU_TARGET_PROGRAMS_PER_SM = 2  # programs per SM the split count aims for
MIN_KEY_TILES_PER_SPLIT = 4  # key tiles of the longest row a split keeps at the least
MAX_SPLITS = 64
GPU_MAX_M = 64  # query rows (tokens x group heads) per GPU program
INTERPRETER_MAX_M = 256  # the interpreter pays per operation, not per element: big tiles
INTERPRETER_KEYS = 128
GPU_COMBINE_PAIRS = 4  # (token, head) pairs per GPU combine program
INTERPRETER_COMBINE_PAIRS = 256
MIN_DOT = 16  # tl.dot's smallest M / N / K on NVIDIA GPUs


@dataclass(frozen=True)
class AttentionTiles:
    """Work per program: `queries` new tokens of one row (times the group's heads), `keys` keys per
    loop iteration; both powers of two, queries x next_power_of_2(group) >= 16 and keys >= 16."""

    queries: int
    keys: int
    warps: int = 4
    combine_pairs: int = GPU_COMBINE_PAIRS  # (token, head) pairs per combine program

    @classmethod
    def choose(
        cls, max_query_len: int, group: int, head_dim: int, head_dim_v: int, interpreted: bool
    ) -> AttentionTiles:
        """GPU: M = tokens x group heads of 16 for decode-sized tiles up to 64 for drafts / prefill,
        64 keys per iteration (32 when a head dimension exceeds 128, and 8 warps). Interpreter: the
        row's whole query span in one program (M up to 256) and 128 keys per iteration."""
        group_p2 = triton.next_power_of_2(group)
        wanted_m = triton.next_power_of_2(max(max_query_len, 1)) * group_p2
        if interpreted:
            block_m = max(MIN_DOT, group_p2, min(wanted_m, INTERPRETER_MAX_M))
            return cls(
                queries=block_m // group_p2, keys=INTERPRETER_KEYS, combine_pairs=INTERPRETER_COMBINE_PAIRS
            )
        block_m = max(MIN_DOT, group_p2, min(wanted_m, GPU_MAX_M))
        wide = max(head_dim, head_dim_v) > 128
        return cls(queries=block_m // group_p2, keys=32 if wide else 64, warps=8 if wide else 4)

    def check(self, group: int) -> None:
        for name, value in (
            ("queries", self.queries),
            ("keys", self.keys),
            ("combine_pairs", self.combine_pairs),
        ):
            if value < 1 or value & (value - 1):
                raise ValueError(f"tiles.{name} must be a power of two, got {value}")
        if self.keys < MIN_DOT or self.queries * triton.next_power_of_2(group) < MIN_DOT:
            raise ValueError(
                f"tiles: keys ({self.keys}) and queries x group heads ({self.queries} x "
                f"{triton.next_power_of_2(group)}) must be at least {MIN_DOT} (tl.dot's smallest tile)"
            )


def kernels_are_interpreted() -> bool:
    """True when triton was imported under TRITON_INTERPRET=1: the kernels then run on CPU tensors."""
    return not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(
    num_rows: int,
    num_kv_heads: int,
    query_tiles: int,
    max_seq_len: int | None,
    keys_per_tile: int,
    num_sms: int,
    read_max_seq_len=None,
) -> int:
    """Key splits per (row, query tile, kv head) program: 1 when the grid already has
    GPU_TARGET_PROGRAMS_PER_SM programs per SM, else enough to get there, each split keeping at
    least MIN_KEY_TILES_PER_SPLIT key tiles of the longest row, at most MAX_SPLITS.
    `read_max_seq_len()` is called (a sync) only when max_seq_len is None and the answer needs it."""
    programs = num_rows * num_kv_heads * query_tiles
    target = GPU_TARGET_PROGRAMS_PER_SM * num_sms
    if programs == 0 or programs >= target:
        return 1
    if max_seq_len is None:
        if read_max_seq_len is None:
            return 1
        max_seq_len = read_max_seq_len()
    key_tiles = triton.cdiv(max(max_seq_len, 1), keys_per_tile)
    return max(1, min(triton.cdiv(target, programs), key_tiles // MIN_KEY_TILES_PER_SPLIT, MAX_SPLITS))


@triton.jit
def _tanh(x):
    """tanh in float32 to a few ulp (the interpreter has no libdevice): a Taylor polynomial near 0,
    where (1 - e^-2|x|) / (1 + e^-2|x|) would cancel, that quotient elsewhere."""
    ax = tl.abs(x)
    t = tl.exp2(ax * (-2.0 * LOG2E))
    quotient = (1.0 - t) / (1.0 + t)
    x2 = ax * ax
    series = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    magnitude = tl.where(ax < 0.125, series, quotient)
    return tl.where(x < 0, -magnitude, magnitude)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [tokens, heads, dim_v] (one split), or the partial outputs [tokens, heads, splits, dim_v] float32
    out_stride_t,
    out_stride_h,
    out_stride_d,
    lse_ptr,  # [tokens, heads, splits] float32 log2-sum-exp2 of each split (SPLIT only)
    q_ptr,
    q_stride_t,
    q_stride_h,
    q_stride_d,
    k_ptr,
    k_stride_b,
    k_stride_s,
    k_stride_h,
    k_stride_d,
    v_ptr,
    v_stride_b,
    v_stride_s,
    v_stride_h,
    v_stride_d,
    block_table_ptr,
    block_table_stride,
    query_start_loc_ptr,
    seq_lens_ptr,
    mask_ptr,  # dense mask (MASK_KIND 1) or tree mask (MASK_KIND 2), uint8 views
    mask_stride_r,
    mask_stride_q,
    mask_stride_k,
    sinks_ptr,
    scale,
    softcap,
    window,
    tree_span,
    num_heads,
    num_query_tiles,
    num_splits,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr,  # 0 causal, 1 dense mask, 2 tree mask over the row's last tree_span keys
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # the interpreter multiplies bfloat16 as its uint16 bit patterns: upcast
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    program = tl.program_id(0)
    row = program // num_query_tiles
    query_tile = program % num_query_tiles
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    query_start = tl.load(query_start_loc_ptr + row).to(tl.int32)
    query_len = tl.load(query_start_loc_ptr + row + 1).to(tl.int32) - query_start
    first_token = query_tile * BLOCK_Q
    if first_token >= query_len:  # the grid is as tall as the longest row
        return
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    context_len = seq_len - query_len

    # M = BLOCK_Q tokens x GROUP_P2 heads, token-major
    lanes = tl.arange(0, BLOCK_M)
    token = first_token + lanes // GROUP_P2  # index among the row's new tokens
    group_head = lanes % GROUP_P2
    head = kv_head * GROUP + group_head
    lane_ok = (token < query_len) & (group_head < GROUP)
    position = context_len + token  # the query's slot in its row
    packed_token = (query_start + token).to(tl.int64)

    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + packed_token[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :] * q_stride_d,
        mask=lane_ok[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # the keys any query of the tile may see: [key_start, key_end)
    last_token = tl.minimum(first_token + BLOCK_Q, query_len) - 1
    if MASK_KIND == 0:
        key_end = context_len + last_token + 1
    else:
        key_end = seq_len
    key_start = 0
    if MASK_KIND != 1:
        if HAS_WINDOW:
            key_start = tl.maximum(context_len + first_token - window + 1, 0)
            key_start = (key_start // BLOCK_N) * BLOCK_N
    if SPLIT:
        tiles_per_split = tl.cdiv(tl.cdiv(key_end - key_start, BLOCK_N), num_splits)
        key_start = key_start + split * tiles_per_split * BLOCK_N
        key_end = tl.minimum(key_end, key_start + tiles_per_split * BLOCK_N)

    if HAS_SINKS and not SPLIT:  # the sink is one more softmax term: start the running max / sum there
        running_max = tl.load(sinks_ptr + head, mask=lane_ok, other=0.0).to(tl.float32) * LOG2E
        running_sum = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if HAS_SOFTCAP:
        score_scale = scale / softcap
    else:
        score_scale = scale * LOG2E

    table_row = block_table_ptr + row.to(tl.int64) * block_table_stride
    key_offsets = tl.arange(0, BLOCK_N)
    for tile_start in range(key_start, key_end, BLOCK_N):
        keys = tile_start + key_offsets
        key_ok = keys < key_end
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        in_block = keys % BLOCK_SIZE
        k = tl.load(
            k_ptr
            + (block * k_stride_b + in_block * k_stride_s + kv_head * k_stride_h)[None, :]
            + dims[:, None] * k_stride_d,
            mask=key_ok[None, :] & (dims[:, None] < HEAD_DIM),
            other=0.0,
        )
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * score_scale
        if HAS_SOFTCAP:
            scores = _tanh(scores) * (softcap * LOG2E)

        visible = lane_ok[:, None] & key_ok[None, :]
        if MASK_KIND == 1:
            allowed = tl.load(
                mask_ptr
                + row.to(tl.int64) * mask_stride_r
                + token[:, None] * mask_stride_q
                + keys[None, :] * mask_stride_k,
                mask=visible,
                other=0,
            )
            visible = visible & (allowed != 0)
        else:
            if MASK_KIND == 2:
                tree_start = seq_len - tree_span  # the tree mask decides the row's last tree_span keys
                in_tree = keys >= tree_start
                allowed = tl.load(
                    mask_ptr
                    + row.to(tl.int64) * mask_stride_r
                    + token[:, None] * mask_stride_q
                    + (keys - tree_start)[None, :] * mask_stride_k,
                    mask=visible & in_tree[None, :],
                    other=0,
                )
                visible = visible & ((keys < tree_start)[None, :] | (allowed != 0))
            else:
                visible = visible & (keys[None, :] <= position[:, None])
            if HAS_WINDOW:
                visible = visible & (position[:, None] - keys[None, :] < window)
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing seen yet: no nan
        rescale = tl.exp2(running_max - safe_max)
        probs = tl.exp2(scores - safe_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        v = tl.load(
            v_ptr
            + (block * v_stride_b + in_block * v_stride_s + kv_head * v_stride_h)[:, None]
            + dims_v[None, :] * v_stride_d,
            mask=key_ok[:, None] & (dims_v[None, :] < HEAD_DIM_V),
            other=0.0,
        )
        probs_v = probs.to(v.dtype)  # as flash-attention: the value dtype for the second product
        if DOT_IN_FP32:
            probs_v, v = probs_v.to(tl.float32), v.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(probs_v, v, input_precision=DOT_PRECISION)
        running_max = new_max

    seen = running_sum > 0
    result = acc / tl.where(seen, running_sum, 1.0)[:, None]
    store_mask = lane_ok[:, None] & (dims_v[None, :] < HEAD_DIM_V)
    if SPLIT:
        pair = packed_token * num_heads + head
        tl.store(
            out_ptr + (pair * num_splits + split)[:, None] * HEAD_DIM_V + dims_v[None, :],
            result,
            mask=store_mask,
        )
        lse = tl.where(seen, running_max + tl.log2(tl.where(seen, running_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + pair * num_splits + split, lse, mask=lane_ok)
    else:
        tl.store(
            out_ptr
            + packed_token[:, None] * out_stride_t
            + head[:, None] * out_stride_h
            + dims_v[None, :] * out_stride_d,
            result.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    out_stride_t,
    out_stride_h,
    out_stride_d,
    partial_ptr,  # [tokens, heads, splits, dim_v] float32
    lse_ptr,  # [tokens, heads, splits] float32, log2 domain (-inf: the split saw nothing)
    sinks_ptr,
    num_pairs,
    num_heads,
    num_splits,
    HEAD_DIM_V: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64) * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    token = pair // num_heads
    head = pair % num_heads
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_DV)
    pair_splits = tl.where(pair < num_pairs, num_splits, 0)
    split_ok = splits[None, :] < pair_splits[:, None]
    lse = tl.load(lse_ptr + pair[:, None] * num_splits + splits[None, :], mask=split_ok, other=float("-inf"))
    top = tl.max(lse, axis=1)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=pair < num_pairs, other=0.0).to(tl.float32) * LOG2E
        top = tl.maximum(top, sink)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - safe_top[:, None])  # [pairs, splits]
    total = tl.sum(weights, axis=1)
    if HAS_SINKS:
        total += tl.exp2(sink - safe_top)
    partial = tl.load(
        partial_ptr
        + (pair[:, None, None] * num_splits + splits[None, :, None]) * HEAD_DIM_V
        + dims[None, None, :],
        mask=split_ok[:, :, None] & (dims[None, None, :] < HEAD_DIM_V),
        other=0.0,
    )
    merged = tl.sum(partial * weights[:, :, None], axis=1) / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * out_stride_t + head[:, None] * out_stride_h + dims[None, :] * out_stride_d,
        merged.to(out_ptr.dtype.element_ty),
        mask=(pair < num_pairs)[:, None] & (dims[None, :] < HEAD_DIM_V),
    )


def _is_int(value) -> bool:
    """A Python or NumPy integer (not a bool, not a tensor: reading one would sync)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...] | None, ndim: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.dim() != ndim or (shape is not None and tuple(tensor.shape) != shape):
        expected = shape if shape is not None else f"{ndim} dimensions"
        raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")


def _check_bool_mask(name: str, tensor: torch.Tensor, num_rows: int, queries: int, keys: int | None) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.bool:
        raise ValueError(
            f"{name} must be a bool tensor, got {getattr(tensor, 'dtype', type(tensor).__name__)}"
        )
    if (
        tensor.dim() != 3
        or tensor.shape[0] != num_rows
        or tensor.shape[1] < queries
        or (keys is not None and tensor.shape[2] < keys)
    ):
        raise ValueError(
            f"{name} must have shape [num_rows={num_rows}, >= max_query_len={queries}, "
            f">= {keys if keys is not None else 'max seq_len'}], got {tuple(tensor.shape)}"
        )


def paged_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int | None = None,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tiles: AttentionTiles | None = None,
) -> torch.Tensor:
    """Attention of every row's new tokens over its paged keys / values (see the module docstring).

    query `[num_tokens, num_heads, head_dim]` packed row after row; key_pool / value_pool
    `[num_blocks, block_size, num_kv_heads, head_dim(_v)]`; block_table `[num_rows, max_blocks]`;
    query_start_loc `[num_rows + 1]`; seq_lens `[num_rows]` (keys held including the new tokens).
    `max_query_len`: the longest row's new tokens; `max_seq_len`: the longest row's keys when the
    caller knows it (else it may be read once for the split decision). `window`, `mask`,
    `tree_mask`, `softcap`, `sinks`: see the module docstring. `out`: where to write the result
    `[num_tokens, num_heads, head_dim_v]` (query's dtype). `num_splits` forces the split-KV count,
    `tiles` the tile sizes (`AttentionTiles.choose` otherwise). Returns the output.

    Tensors must be on one CUDA device, or on CPU when triton was imported under TRITON_INTERPRET=1.
    """
    _check_inputs(
        query, key_pool, value_pool, block_table, query_start_loc, seq_lens, max_query_len, max_seq_len,
        window, mask, tree_mask, softcap, sinks, out, num_splits,
    )  # fmt: skip
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, head_dim_v = value_pool.shape
    num_rows = seq_lens.shape[0]
    max_query_len = int(max_query_len)
    max_seq_len = None if max_seq_len is None else int(max_seq_len)
    group = num_heads // num_kv_heads
    interpreted = kernels_are_interpreted()
    if out is None:
        out = query.new_empty((num_tokens, num_heads, head_dim_v))
    if num_tokens == 0 or num_rows == 0 or max_query_len == 0:
        return out

    tiles = tiles or AttentionTiles.choose(max_query_len, group, head_dim, head_dim_v, interpreted)
    tiles.check(group)
    query_tiles = triton.cdiv(max_query_len, tiles.queries)
    if num_splits is None:
        if interpreted:
            num_splits = 1
        else:
            num_splits = choose_num_splits(
                num_rows,
                num_kv_heads,
                query_tiles,
                max_seq_len,
                tiles.keys,
                _multiprocessor_count(
                    query.device.index if query.device.index is not None else torch.cuda.current_device()
                ),
                read_max_seq_len=lambda: int(seq_lens.max()),
            )

    num_splits = int(num_splits)
    mask_kind, mask_arg = 0, None
    if mask is not None:
        mask_kind, mask_arg = 1, mask
    elif tree_mask is not None:
        mask_kind, mask_arg = 2, tree_mask
    mask_strides = (0, 0, 0)
    if mask_arg is not None:
        mask_arg = mask_arg.view(torch.uint8)  # same bytes; triton loads bytes more predictably than i1
        mask_strides = mask_arg.stride()
    else:
        mask_arg = block_table
    sinks_arg = sinks if sinks is not None else query

    # Triton's interpreter (3.9) multiplies bfloat16 dot operands as their raw uint16 bits: there the
    # products run on the operands upcast to float32 (exact for bfloat16 inputs, as tensor cores are)
    bf16_dot_in_fp32 = interpreted and query.dtype == torch.bfloat16
    split = num_splits > 1
    if split:
        target = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim_v), dtype=torch.float32, device=query.device
        )
        lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        target_strides = (0, 0, 0)  # the partial layout is fixed (contiguous)
    else:
        target, lse, target_strides = out, out, out.stride()

    grid = (num_rows * query_tiles, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        target,
        *target_strides,
        lse,
        query,
        *query.stride(),
        key_pool,
        *key_pool.stride(),
        value_pool,
        *value_pool.stride(),
        block_table,
        block_table.stride(0),
        query_start_loc,
        seq_lens,
        mask_arg,
        *mask_strides,
        sinks_arg,
        float(scale),
        float(softcap) if softcap is not None else 1.0,
        int(window) if window is not None else 0,
        tree_mask.shape[2] if tree_mask is not None else 0,
        num_heads,
        query_tiles,
        num_splits,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_P2=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_DV=max(MIN_DOT, triton.next_power_of_2(head_dim_v)),
        BLOCK_Q=tiles.queries,
        BLOCK_N=tiles.keys,
        MASK_KIND=mask_kind,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        SPLIT=split,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or bf16_dot_in_fp32 else "tf32",
        DOT_IN_FP32=bf16_dot_in_fp32,
        num_warps=tiles.warps,
    )
    if split:
        num_pairs = num_tokens * num_heads
        _combine_splits_kernel[(triton.cdiv(num_pairs, tiles.combine_pairs),)](
            out,
            *out.stride(),
            target,
            lse,
            sinks_arg,
            num_pairs,
            num_heads,
            num_splits,
            HEAD_DIM_V=head_dim_v,
            HAS_SINKS=sinks is not None,
            BLOCK_PAIRS=tiles.combine_pairs,
            BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            BLOCK_DV=triton.next_power_of_2(head_dim_v),
            num_warps=4,
        )
    return out


def _check_inputs(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int | None,
    window: int | None,
    mask: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor | None,
    num_splits: int | None,
) -> None:
    """ValueErrors naming the argument; no device sync."""
    for name, tensor, ndim in (("query", query, 3), ("key_pool", key_pool, 4), ("value_pool", value_pool, 4)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != ndim:
            raise ValueError(f"{name} must be a {ndim}-d tensor, got {tuple(getattr(tensor, 'shape', ()))}")
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {tensor.dtype}")
    if key_pool.dtype != query.dtype or value_pool.dtype != query.dtype:
        raise ValueError(
            f"key_pool and value_pool must have query's dtype {query.dtype}, got {key_pool.dtype} / {value_pool.dtype}"
        )
    num_tokens, num_heads, head_dim = query.shape
    if key_pool.shape[:3] != value_pool.shape[:3]:
        raise ValueError(
            f"key_pool {tuple(key_pool.shape)} and value_pool {tuple(value_pool.shape)} must agree on "
            "[num_blocks, block_size, num_kv_heads]"
        )
    if key_pool.shape[-1] != head_dim:
        raise ValueError(f"key_pool's head_dim {key_pool.shape[-1]} differs from query's {head_dim}")
    num_kv_heads = key_pool.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if key_pool.shape[1] < 1:
        raise ValueError("key_pool's block_size must be at least 1")
    if head_dim < 1 or value_pool.shape[-1] < 1:
        raise ValueError("head dimensions must be at least 1")
    _check_int_tensor("seq_lens", seq_lens, None, 1)
    num_rows = seq_lens.shape[0]
    _check_int_tensor("query_start_loc", query_start_loc, (num_rows + 1,), 1)
    _check_int_tensor("block_table", block_table, None, 2)
    if block_table.shape[0] != num_rows:
        raise ValueError(f"block_table must have num_rows={num_rows} rows, got {tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table's rows must be contiguous (stride 1 along the blocks)")
    if not _is_int(max_query_len) or max_query_len < 0:
        raise ValueError(f"max_query_len must be an int >= 0, got {max_query_len!r}")
    if max_seq_len is not None and (not _is_int(max_seq_len) or max_seq_len < 0):
        raise ValueError(f"max_seq_len must be None or an int >= 0, got {max_seq_len!r}")
    if window is not None and (not _is_int(window) or window < 1):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap!r}")
    if num_splits is not None and (not _is_int(num_splits) or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    if mask is not None and tree_mask is not None:
        raise ValueError("give mask or tree_mask, not both (a dense mask already decides every key)")
    if mask is not None:
        _check_bool_mask("mask", mask, num_rows, max_query_len, max_seq_len)
    if tree_mask is not None:
        _check_bool_mask("tree_mask", tree_mask, num_rows, max_query_len, max_query_len)
    if sinks is not None:
        if (
            not isinstance(sinks, torch.Tensor)
            or sinks.shape != (num_heads,)
            or not sinks.is_floating_point()
        ):
            raise ValueError(
                f"sinks must be a float tensor of shape [num_heads={num_heads}], got "
                f"{tuple(getattr(sinks, 'shape', ()))} {getattr(sinks, 'dtype', type(sinks).__name__)}"
            )
    if out is not None:
        expected = (num_tokens, num_heads, value_pool.shape[-1])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected or out.dtype != query.dtype:
            raise ValueError(
                f"out must be a {query.dtype} tensor of shape {expected}, got "
                f"{tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', None)}"
            )
    device = query.device
    named = {
        "key_pool": key_pool, "value_pool": value_pool, "block_table": block_table,
        "query_start_loc": query_start_loc, "seq_lens": seq_lens, "mask": mask, "tree_mask": tree_mask,
        "sinks": sinks, "out": out,
    }  # fmt: skip
    for name, tensor in named.items():
        if tensor is not None and tensor.device != device:
            raise ValueError(
                f"{name} is on {tensor.device}, query on {device}: all tensors must share a device"
            )
    if device.type != "cuda" and not kernels_are_interpreted():
        raise ValueError(
            f"paged_attention got {device.type} tensors; CPU tensors need TRITON_INTERPRET=1 set before "
            "triton is first imported"
        )
