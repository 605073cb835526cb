"""The Triton paged attention kernel (`hf_specdec.kernels.paged_attention`) against a plain PyTorch
reference written here: each row's keys gathered through its block table, the visibility mask built
from the row's slots, softmax in float64.

Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py before triton is imported) runs the
kernels on CPU tensors, so no GPU is needed; triton itself is, and these tests fail without it.
Cases are ragged (rows of 0 to 33 new tokens: one-token decode rows, 32-draft rows, a row with
no context), their blocks scattered through the pool in random order, with every slot the kernel
must not read (free blocks, slots past a row's length) holding NaN: one read of them shows in the
output. The kernels run both with the interpreter's tiles (one query tile per row, 128 keys) and
with the tiles a GPU launch picks (`AttentionTiles.choose(..., interpreted=False)`: small query
tiles, 32 / 64 keys, so tile skipping and several key tiles per program are exercised), and with
the key range split (flash-decoding) and without.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import triton  # noqa: F401  (a missing triton must fail these tests, not skip them)

FP32_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
LOW_PRECISION_TOLERANCE = dict(rtol=3e-2, atol=3e-2)


@pytest.fixture(scope="module")
def kernels():
    """The kernel module, run by Triton's interpreter (conftest sets TRITON_INTERPRET=1 first)."""
    from hf_specdec.kernels import paged_attention

    assert paged_attention.kernels_are_interpreted(), (
        "TRITON_INTERPRET=1 was not set when triton was first imported (tests/conftest.py sets it)"
    )
    return paged_attention


@dataclass
class Case:
    query: torch.Tensor  # [tokens, heads, dim]
    key_pool: torch.Tensor  # [blocks, block_size, kv_heads, dim]
    value_pool: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    q_lens: list[int]
    scale: float

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max()) if len(self.q_lens) else 0

    def arguments(self) -> tuple:
        return (
            self.query,
            self.key_pool,
            self.value_pool,
            self.block_table,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
        )


def make_case(
    seed: int,
    q_lens: list[int],
    contexts: list[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    head_dim_v: int | None = None,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int64,
) -> Case:
    """Rows with q_lens[r] new tokens after contexts[r] keys; blocks shuffled through the pool, a few
    spare ones, block tables padded with -1, and NaN in every slot that is not a row's key."""
    generator = torch.Generator().manual_seed(seed)
    head_dim_v = head_dim_v or head_dim
    seq_lens = [c + q for c, q in zip(contexts, q_lens)]
    blocks_per_row = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_row) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(max(blocks_per_row, default=0), 1) + 1
    block_table = torch.full((len(q_lens), width), -1, dtype=torch.int64)
    key_pool = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    value_pool = torch.full((num_blocks, block_size, num_kv_heads, head_dim_v), float("nan"))
    taken = 0
    for row, (count, seq_len) in enumerate(zip(blocks_per_row, seq_lens)):
        block_table[row, :count] = torch.tensor(order[taken : taken + count], dtype=torch.int64)
        taken += count
        for j in range(seq_len):  # only the row's keys are numbers
            block, offset = int(block_table[row, j // block_size]), j % block_size
            key_pool[block, offset] = torch.randn(num_kv_heads, head_dim, generator=generator)
            value_pool[block, offset] = torch.randn(num_kv_heads, head_dim_v, generator=generator)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=index_dtype)
    return Case(
        query=query.to(dtype),
        key_pool=key_pool.to(dtype),
        value_pool=value_pool.to(dtype),
        block_table=block_table.to(index_dtype),
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=index_dtype),
        q_lens=list(q_lens),
        scale=head_dim**-0.5,
    )


def random_tree(generator: torch.Generator, q_len: int) -> torch.Tensor:
    """[q_len, q_len] bool: each new token sees itself and its ancestors in a random draft tree
    (token a's parent is a random earlier token, or none: it hangs off the context)."""
    tree = torch.zeros(q_len, q_len, dtype=torch.bool)
    for a in range(q_len):
        tree[a, a] = True
        parent = int(torch.randint(-1, a, (1,), generator=generator)) if a else -1
        if parent >= 0:
            tree[a] |= tree[parent]
    return tree


def tree_masks(case: Case, seed: int, extra: int = 3) -> torch.Tensor:
    """[rows, max_query_len, T] over each row's last T = max_query_len + extra keys: a random tree
    among its new tokens (the last q_len columns) and random visibility of the keys before them (as a
    drafter's own earlier tree entries)."""
    generator = torch.Generator().manual_seed(seed)
    width = case.max_query_len + extra
    masks = torch.rand(len(case.q_lens), case.max_query_len, width, generator=generator) < 0.5
    for row, q_len in enumerate(case.q_lens):
        masks[row, :q_len, width - q_len :] = random_tree(generator, q_len)
    return masks


def dense_mask(case: Case, seed: int, fully_masked: list[tuple[int, int]] = ()) -> torch.Tensor:
    """A random mask over [rows, max_query_len, max_seq_len + 5] (keys past a row's length set True:
    they must still never be seen), with the given (row, query) pairs seeing nothing."""
    generator = torch.Generator().manual_seed(seed)
    shape = (len(case.q_lens), case.max_query_len, case.max_seq_len + 5)
    mask = torch.rand(shape, generator=generator) < 0.6
    for row, seq_len in enumerate(case.seq_lens.tolist()):
        mask[row, :, seq_len:] = True
    for row, query in fully_masked:
        mask[row, query, : int(case.seq_lens[row])] = False
    return mask


def reference(
    case: Case,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The semantics, one row at a time in float64: gather, scores, cap, mask, softmax (with the sink
    as one more logit), weights x values; a query that sees nothing gets zeros."""
    num_tokens, num_heads, _ = case.query.shape
    _, block_size, num_kv_heads, head_dim_v = case.value_pool.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim_v, dtype=torch.float64)
    flat_keys = case.key_pool.flatten(0, 1).double()
    flat_values = case.value_pool.flatten(0, 1).double()
    starts = case.query_start_loc.tolist()
    for row, (q_len, seq_len) in enumerate(zip(case.q_lens, case.seq_lens.tolist())):
        if q_len == 0:
            continue
        j = torch.arange(seq_len)
        slots = case.block_table[row, j // block_size].long() * block_size + j % block_size
        keys = flat_keys[slots].repeat_interleave(group, dim=1)  # [S, H, D]
        values = flat_values[slots].repeat_interleave(group, dim=1)
        queries = case.query[starts[row] : starts[row] + q_len].double()  # [L, H, D]
        scores = torch.einsum("lhd,shd->hls", queries, keys) * case.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        context = seq_len - q_len
        position = context + torch.arange(q_len)[:, None]  # [L, 1]
        if mask is not None:
            visible = mask[row, :q_len, :seq_len]
        else:
            if tree_mask is not None:  # the row's last T keys follow the tree mask
                span = tree_mask.shape[2]
                in_tree = j >= seq_len - span
                tree_visible = torch.zeros(q_len, seq_len, dtype=torch.bool)
                tree_visible[:, in_tree] = tree_mask[row, :q_len, span - int(in_tree.sum()) :]
                visible = ~in_tree[None, :] | tree_visible
            else:
                visible = j[None, :] <= position
            if window is not None:
                visible = visible & (position - j[None, :] < window)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if sinks is not None:
            sink_column = sinks.double()[:, None, None].expand(num_heads, q_len, 1)
            scores = torch.cat([scores, sink_column], dim=-1)
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :seq_len]  # all -inf: nan -> 0
        out[starts[row] : starts[row] + q_len] = torch.einsum("hls,shd->lhd", weights, values)
    return out


def assert_matches(result: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else LOW_PRECISION_TOLERANCE
    assert result.dtype == dtype
    assert not result.isnan().any()
    torch.testing.assert_close(result.double(), expected, **tolerance)


def gpu_tiles(kernels, case: Case):
    """The tiles a CUDA launch picks for this case, run under the interpreter."""
    num_heads, num_kv_heads = case.query.shape[1], case.key_pool.shape[2]
    return kernels.AttentionTiles.choose(
        case.max_query_len, num_heads // num_kv_heads, case.query.shape[-1], case.value_pool.shape[-1], False
    )


# ragged rows: a 32-draft row, one-token decode rows, a row with nothing new, a 33-token row, a
# row without context, contexts up to ~290 keys
Q_LENS = [32, 1, 0, 5, 33, 1, 9]
CONTEXTS = [40, 290, 17, 0, 100, 3, 180]


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, head_dim_v, block_size, dtype",
    [
        (4, 4, 64, 64, 16, torch.float32),  # MHA
        (4, 2, 128, 128, 1, torch.float32),  # GQA 2, one-token blocks
        (8, 2, 80, 80, 32, torch.float32),  # GQA 4, a head size that is not a power of two
        (8, 1, 256, 256, 16, torch.float32),  # GQA 8 (MQA), wide heads
        (4, 2, 96, 64, 5, torch.float32),  # values narrower than keys, a block size not a power of two
        (8, 2, 128, 128, 16, torch.bfloat16),
        (8, 1, 64, 64, 32, torch.bfloat16),
        (4, 2, 64, 64, 16, torch.float16),
    ],
)
def test_causal_matches_reference(kernels, num_heads, num_kv_heads, head_dim, head_dim_v, block_size, dtype):
    case = make_case(0, Q_LENS, CONTEXTS, num_heads, num_kv_heads, head_dim, head_dim_v, block_size, dtype)
    expected = reference(case)
    result = kernels.paged_attention(*case.arguments(), max_query_len=case.max_query_len)
    assert result.shape == (case.query.shape[0], num_heads, head_dim_v)
    assert_matches(result, expected, dtype)


@pytest.mark.parametrize("num_kv_heads, num_heads, head_dim", [(2, 2, 64), (2, 4, 128), (1, 8, 256)])
def test_gpu_tiles_and_splits_match_reference(kernels, num_kv_heads, num_heads, head_dim):
    """With the GPU's small tiles (several query tiles per row, many key tiles per program), with one
    split and with several, including more splits than some rows have key tiles."""
    case = make_case(1, Q_LENS, CONTEXTS, num_heads, num_kv_heads, head_dim)
    tiles = gpu_tiles(kernels, case)
    assert tiles.keys in (32, 64) and tiles.queries * triton.next_power_of_2(num_heads // num_kv_heads) <= 64
    expected = reference(case)
    results = [
        kernels.paged_attention(
            *case.arguments(), max_query_len=case.max_query_len, num_splits=splits, tiles=tiles
        )
        for splits in (1, 3, 8)
    ]
    for result in results:
        assert_matches(result, expected, torch.float32)
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[2], results[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [1, 7, 40, 1000])
def test_sliding_window(kernels, window):
    """Windows shorter than a token's span of new keys, shorter and longer than the contexts: the
    GPU tiles skip the key tiles before a query tile's window, with and without splits."""
    case = make_case(2, Q_LENS, CONTEXTS, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    expected = reference(case, window=window)
    tiles = gpu_tiles(kernels, case)
    for splits, tile_choice in ((None, None), (1, tiles), (4, tiles)):
        result = kernels.paged_attention(
            *case.arguments(),
            max_query_len=case.max_query_len,
            max_seq_len=case.max_seq_len,
            window=window,
            num_splits=splits,
            tiles=tile_choice,
        )
        assert_matches(result, expected, torch.float32)


def test_window_skipping_at_every_tile_boundary(kernels):
    """16-key tiles and rows whose window starts fall on every residue modulo 16: the first key tile
    a program reads is exactly the one holding its first token's oldest visible key."""
    contexts = list(range(30, 46))
    case = make_case(14, [3, 1] * 8, contexts, num_heads=4, num_kv_heads=2, head_dim=64, block_size=4)
    tiles = kernels.AttentionTiles(queries=8, keys=16)
    for window in (5, 16, 17):
        result = kernels.paged_attention(*case.arguments(), max_query_len=3, window=window, tiles=tiles)
        assert_matches(result, reference(case, window=window), torch.float32)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize(
    "softcap, with_sinks, window, dtype",
    [
        (30.0, False, None, torch.float32),  # Gemma 2's attention softcap
        (0.5, False, 20, torch.float32),  # a small cap: scores near its saturation
        (None, True, None, torch.float32),  # gpt-oss
        (None, True, 24, torch.float32),  # gpt-oss's sliding layers
        (50.0, True, None, torch.bfloat16),
    ],
)
def test_softcap_and_sinks(kernels, softcap, with_sinks, window, dtype, splits):
    case = make_case(3, Q_LENS, CONTEXTS, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype)
    sinks = None
    if with_sinks:  # some far above the scores, some far below
        sinks = torch.tensor([0.5, -1.0, 3.0, 8.0, -20.0, 0.0, 1.5, 2.0], dtype=dtype)
    expected = reference(case, window=window, softcap=softcap, sinks=sinks)
    result = kernels.paged_attention(
        *case.arguments(),
        max_query_len=case.max_query_len,
        window=window,
        softcap=softcap,
        sinks=sinks,
        num_splits=splits,
        tiles=gpu_tiles(kernels, case) if splits > 1 else None,
    )
    assert_matches(result, expected, dtype)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_dense_mask_and_a_query_that_sees_nothing(kernels, with_sinks):
    """A dense mask replaces causality and the window; keys past a row's length stay unseen even
    where the mask says True; a query whose mask is all False gets zeros (sinks or not)."""
    case = make_case(4, Q_LENS, CONTEXTS, num_heads=4, num_kv_heads=1, head_dim=64, block_size=16)
    fully_masked = [(0, 3), (1, 0), (4, 32)]
    mask = dense_mask(case, 5, fully_masked)
    sinks = torch.tensor([0.0, 1.0, -2.0, 4.0]) if with_sinks else None
    expected = reference(case, mask=mask, sinks=sinks)
    starts = case.query_start_loc.tolist()
    for row, query in fully_masked:
        assert expected[starts[row] + query].abs().max() == 0
    for splits, tiles in ((1, None), (3, gpu_tiles(kernels, case))):
        result = kernels.paged_attention(
            *case.arguments(),
            max_query_len=case.max_query_len,
            window=4,  # ignored: the mask decides
            mask=mask,
            sinks=sinks,
            num_splits=splits,
            tiles=tiles,
        )
        assert_matches(result, expected, torch.float32)
        for row, query in fully_masked:
            assert result[starts[row] + query].abs().max() == 0


@pytest.mark.parametrize("window", [None, 30])
def test_tree_mask(kernels, window):
    """Draft trees: each new token sees the keys before the row's last T (within the window) and, among
    those T, exactly what the tree mask says (its ancestors and itself among the new tokens)."""
    case = make_case(6, Q_LENS, CONTEXTS, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    trees = tree_masks(case, 7)
    expected = reference(case, window=window, tree_mask=trees)
    # a tree is not the causal chain: the results must differ from causal attention somewhere
    assert not torch.allclose(expected, reference(case, window=window))
    for splits, tiles in ((1, None), (1, gpu_tiles(kernels, case)), (3, gpu_tiles(kernels, case))):
        result = kernels.paged_attention(
            *case.arguments(),
            max_query_len=case.max_query_len,
            window=window,
            tree_mask=trees,
            num_splits=splits,
            tiles=tiles,
        )
        assert_matches(result, expected, torch.float32)


def test_int32_indices_strided_query_and_out(kernels):
    """int32 block table / lengths, a query that is a strided view (heads of a fused projection), and
    `out=` written in place and returned."""
    case = make_case(
        8, [3, 1, 17], [20, 50, 0], num_heads=4, num_kv_heads=2, head_dim=64, index_dtype=torch.int32
    )
    fused = torch.randn(case.query.shape[0], 8, 64)
    fused[:, ::2] = case.query
    case.query = fused[:, ::2]
    assert not case.query.is_contiguous()
    expected = reference(case)
    out = torch.full((case.query.shape[0], 4, 64), float("nan"))
    result = kernels.paged_attention(*case.arguments(), max_query_len=17, max_seq_len=50, out=out)
    assert result is out
    assert_matches(result, expected, torch.float32)


def test_empty_batches(kernels):
    """No rows, and rows that all have zero new tokens: an empty output, no launch needed."""
    case = make_case(9, [0, 0], [5, 0])
    result = kernels.paged_attention(*case.arguments(), max_query_len=0)
    assert result.shape == (0, 4, 64)
    none = make_case(9, [], [])
    assert kernels.paged_attention(*none.arguments(), max_query_len=0).shape == (0, 4, 64)


def test_gpu_tile_and_split_choices(kernels):
    """The launch heuristics, as pure functions of host-known sizes (an H100 / H200 has 132 SMs)."""
    choose = kernels.AttentionTiles.choose
    decode = choose(1, 8, 128, 128, interpreted=False)
    assert (decode.queries, decode.keys) == (2, 64)  # M = 2 tokens x 8 heads = 16
    verify = choose(33, 4, 128, 128, interpreted=False)
    assert (verify.queries * 4, verify.keys) == (64, 64)
    wide = choose(5, 2, 256, 256, interpreted=False)
    assert (wide.keys, wide.warps) == (32, 8)
    mha = choose(1, 1, 64, 64, interpreted=False)
    assert mha.queries == 16  # tl.dot's smallest M
    assert choose(33, 8, 64, 64, interpreted=True).queries == 32  # M capped at 256 under the interpreter

    def splits(rows, kv_heads, query_tiles, max_seq_len, reader=None):
        return kernels.choose_num_splits(rows, kv_heads, query_tiles, max_seq_len, 64, 132, reader)

    assert splits(1, 8, 1, 32_768) == 33  # one long decode row: fill 264 programs
    assert splits(1, 8, 1, 1_000) == 4  # 16 key tiles: at least 4 per split
    assert splits(1, 8, 1, 100) == 1  # too short to split
    assert splits(4, 8, 1, 1_000_000) == 9
    assert splits(1, 1, 1, 10_000_000) == kernels.MAX_SPLITS
    assert splits(64, 8, 1, None) == 1  # 512 programs already: max_seq_len not needed
    read = []
    assert splits(2, 8, 1, None, lambda: read.append(1) or 4_096) == 16
    assert read == [1]  # read once, only when needed


def test_forced_splits_agree_on_one_long_row(kernels):
    """Flash-decoding's case: one decode row and one short verify row over a long context; every split
    count gives the reference's result."""
    case = make_case(10, [1, 6], [300, 250], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    expected = reference(case)
    tiles = gpu_tiles(kernels, case)
    for splits in (1, 2, 5, 16):
        result = kernels.paged_attention(
            *case.arguments(), max_query_len=6, max_seq_len=301, num_splits=splits, tiles=tiles
        )
        assert_matches(result, expected, torch.float32)


def error_cases():
    def base(**changes):
        case = make_case(11, [2, 3], [4, 5])
        arguments = dict(
            query=case.query,
            key_pool=case.key_pool,
            value_pool=case.value_pool,
            block_table=case.block_table,
            query_start_loc=case.query_start_loc,
            seq_lens=case.seq_lens,
            scale=0.125,
            max_query_len=3,
        )
        arguments.update(changes)
        return arguments

    case = make_case(11, [2, 3], [4, 5])
    good_mask = torch.ones(2, 3, 8, dtype=torch.bool)
    good_tree = torch.ones(2, 3, 3, dtype=torch.bool)
    return [
        ("query", base(query=case.query[0])),
        ("query", base(query=case.query.to(torch.int32))),
        ("key_pool and value_pool", base(key_pool=case.key_pool.half())),
        ("key_pool", base(key_pool=case.key_pool.double())),
        ("key_pool's head_dim", base(key_pool=case.key_pool[..., :32], value_pool=case.value_pool[..., :32])),
        ("num_kv_heads", base(query=torch.randn(5, 3, 64))),
        ("key_pool", base(value_pool=case.value_pool[:, :, :1])),
        ("seq_lens", base(seq_lens=case.seq_lens.float())),
        ("query_start_loc", base(query_start_loc=case.query_start_loc[:2])),
        ("block_table", base(block_table=case.block_table[:1])),
        ("max_query_len", base(max_query_len=-1)),
        ("max_seq_len", base(max_seq_len=-3)),
        ("window", base(window=0)),
        ("softcap", base(softcap=0.0)),
        ("num_splits", base(num_splits=0)),
        ("mask or tree_mask", base(mask=good_mask, tree_mask=good_tree)),
        ("mask", base(mask=good_mask.int())),
        ("mask", base(mask=good_mask[:, :, :4], max_seq_len=8)),
        ("tree_mask", base(tree_mask=good_tree[:, :2])),
        ("sinks", base(sinks=torch.zeros(3))),
        ("out", base(out=torch.empty(5, 4, 64, dtype=torch.bfloat16))),
        ("out", base(out=torch.empty(5, 4, 32))),
    ]


ERROR_CASES = error_cases()


@pytest.mark.parametrize(
    "name, arguments", ERROR_CASES, ids=[f"{i}-{name}" for i, (name, _) in enumerate(ERROR_CASES)]
)
def test_invalid_arguments_raise_value_errors_naming_them(kernels, name, arguments):
    arguments = dict(arguments)
    positional = [
        arguments.pop(key)
        for key in ("query", "key_pool", "value_pool", "block_table", "query_start_loc", "seq_lens", "scale")
    ]
    with pytest.raises(ValueError, match=name.replace("(", r"\(")):
        kernels.paged_attention(*positional, **arguments)


def test_too_small_tiles_are_refused(kernels):
    case = make_case(12, [2], [3], num_heads=2, num_kv_heads=2)
    with pytest.raises(ValueError, match="tiles"):
        kernels.paged_attention(
            *case.arguments(), max_query_len=2, tiles=kernels.AttentionTiles(queries=4, keys=64)
        )
    with pytest.raises(ValueError, match="tiles"):
        kernels.paged_attention(
            *case.arguments(), max_query_len=2, tiles=kernels.AttentionTiles(queries=16, keys=8)
        )


def test_reference_agrees_with_sdpa():
    """The test's own reference against PyTorch's SDPA on the gathered rows (causal, GQA), so the
    kernel is held to the semantics of the portable path, not only to this file."""
    case = make_case(13, [4, 1], [6, 9], num_heads=4, num_kv_heads=2, head_dim=64, block_size=4)
    expected = reference(case)
    starts = case.query_start_loc.tolist()
    for row, (q_len, seq_len) in enumerate(zip(case.q_lens, case.seq_lens.tolist())):
        j = torch.arange(seq_len)
        slots = case.block_table[row, j // 4] * 4 + j % 4
        keys = case.key_pool.flatten(0, 1)[slots].transpose(0, 1)[None]  # [1, kv_heads, S, D]
        values = case.value_pool.flatten(0, 1)[slots].transpose(0, 1)[None]
        queries = case.query[starts[row] : starts[row] + q_len].transpose(0, 1)[None]
        visible = j[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=visible, scale=case.scale, enable_gqa=True
        )
        torch.testing.assert_close(
            sdpa[0].transpose(0, 1).double(), expected[starts[row] : starts[row] + q_len], **FP32_TOLERANCE
        )
