"""PagedKVCache bookkeeping, and packed forwards through the paged attention path."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_tiny_llama, ngram_config, plain_generate, repeated_span_batch

import hf_specdec
from hf_specdec import CacheExhaustedError, PagedKVCache
from hf_specdec.cache.paged_attention import ATTENTION_NAME, use_paged_attention

NUM_KV_HEADS, HEAD_DIM = 2, 4


def small_cache(num_blocks: int = 16, block_size: int = 4, num_layers: int = 2) -> PagedKVCache:
    return PagedKVCache(
        num_layers=num_layers,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        num_blocks=num_blocks,
        block_size=block_size,
    )


def write(cache: PagedKVCache, rows: list[int], counts: list[int], seed: int = 0):
    """prepare_forward + the writes a model forward would do; returns the metadata and the keys written."""
    meta = cache.prepare_forward(rows, counts)
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, NUM_KV_HEADS, sum(counts), HEAD_DIM, generator=generator)
    values = torch.randn(1, NUM_KV_HEADS, sum(counts), HEAD_DIM, generator=generator)
    for layer in cache.layers:
        layer.update(keys, values, kwargs={"paged_metadata": meta})
    return meta, keys, values


def slots_of(cache: PagedKVCache, row: int, positions) -> list[int]:
    table = cache.block_tables[row]
    return [table[p // cache.block_size] * cache.block_size + p % cache.block_size for p in positions]


def test_prepare_forward_allocates_ceil_blocks_per_row():
    cache = small_cache(num_blocks=16, block_size=4)
    meta = cache.prepare_forward([0, 1, 2], [5, 9, 4])
    assert [len(cache.block_tables[r]) for r in (0, 1, 2)] == [2, 3, 1]
    assert cache.num_blocks_used == 6
    assert cache.seq_lens == {0: 5, 1: 9, 2: 4}
    assert cache.num_tokens_held == 18
    assert meta.query_start_loc.tolist() == [0, 5, 14, 18]
    assert meta.seq_lens.tolist() == [5, 9, 4]
    # blocks are disjoint, lowest ids first
    all_blocks = [b for r in (0, 1, 2) for b in cache.block_tables[r]]
    assert sorted(all_blocks) == list(range(6))
    # every new token gets its own slot, inside its row's blocks at its position
    expected = slots_of(cache, 0, range(5)) + slots_of(cache, 1, range(9)) + slots_of(cache, 2, range(4))
    assert meta.slot_mapping.tolist() == expected
    assert len(set(expected)) == 18
    # a second forward continues each row where it stopped, allocating only what is missing
    for step, (counts, lengths) in enumerate((([3, 1, 1], [8, 10, 5]), ([1, 2, 4], [9, 12, 9]))):
        meta = cache.prepare_forward([0, 1, 2], counts)
        assert [cache.seq_lens[r] for r in (0, 1, 2)] == lengths, step
        assert [len(cache.block_tables[r]) for r in (0, 1, 2)] == [math.ceil(n / 4) for n in lengths]
        assert cache.num_blocks_used == sum(math.ceil(n / 4) for n in lengths)
        expected = [
            s
            for r, n, c in zip((0, 1, 2), lengths, counts, strict=True)
            for s in slots_of(cache, r, range(n - c, n))
        ]
        assert meta.slot_mapping.tolist() == expected


@pytest.mark.parametrize("block_size", (1, 3, 16))
def test_block_count_matches_tokens(block_size):
    cache = small_cache(num_blocks=64, block_size=block_size)
    rows = list(range(5))
    counts = [1, 2, 7, 16, 17]
    cache.prepare_forward(rows, counts)
    assert cache.num_blocks_used == sum(math.ceil(c / block_size) for c in counts)
    for row, count in zip(rows, counts, strict=True):
        assert len(cache.block_tables[row]) == math.ceil(count / block_size)


def test_rollback_frees_whole_surplus_blocks_and_keeps_data():
    cache = small_cache(num_blocks=16, block_size=4)
    write(cache, [0, 1], [11, 6], seed=1)
    assert [len(cache.block_tables[r]) for r in (0, 1)] == [3, 2]
    pools_before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    kept_blocks = list(cache.block_tables[0][:2])

    cache.rollback(0, 5)  # 11 -> 5 tokens: 3 -> 2 blocks
    assert cache.seq_lens[0] == 5
    assert cache.block_tables[0] == kept_blocks
    assert cache.num_blocks_used == 4
    # nothing was erased or moved
    for layer, (keys, values) in zip(cache.layers, pools_before, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)

    cache.rollback(0, 4)  # exactly one block
    assert cache.block_tables[0] == kept_blocks[:1] and cache.num_blocks_used == 3
    cache.rollback(0, 4)  # no-op
    assert cache.block_tables[0] == kept_blocks[:1] and cache.seq_lens[0] == 4
    cache.rollback(1, 5)  # same block count: nothing freed
    assert len(cache.block_tables[1]) == 2 and cache.seq_lens[1] == 5 and cache.num_blocks_used == 3
    cache.rollback(0, 0)
    assert cache.block_tables[0] == [] and cache.seq_lens[0] == 0 and cache.num_blocks_used == 2
    # the other row is untouched throughout
    assert cache.seq_lens[1] == 5

    with pytest.raises(ValueError, match="cannot roll row 1 forward"):
        cache.rollback(1, 6)


def test_rollback_then_forward_overwrites_only_the_stale_slots():
    cache = small_cache(num_blocks=16, block_size=4)
    _, keys, _ = write(cache, [0], [10], seed=2)
    kept_slots = slots_of(cache, 0, range(7))
    cache.rollback(0, 7)
    meta, new_keys, _ = write(cache, [0], [4], seed=3)
    assert meta.slot_mapping.tolist() == slots_of(cache, 0, range(7, 11))
    pool = cache.layers[0].keys.view(-1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(pool[kept_slots], keys[0].transpose(0, 1)[:7])
    assert torch.equal(pool[slots_of(cache, 0, range(7, 11))], new_keys[0].transpose(0, 1))
    assert cache.seq_lens[0] == 11 and len(cache.block_tables[0]) == 3


def test_free_row_returns_blocks_for_reuse():
    cache = small_cache(num_blocks=8, block_size=4)
    cache.prepare_forward([0, 1, 2], [8, 4, 12])
    freed = list(cache.block_tables[0])
    assert freed == [0, 1]
    assert cache.num_blocks_used == 6
    cache.free_row(0)
    assert 0 not in cache.block_tables and 0 not in cache.seq_lens
    assert cache.num_blocks_used == 4
    cache.prepare_forward([3], [7])
    assert cache.block_tables[3] == freed
    cache.free_row(3)
    cache.free_row(3)  # freeing twice is harmless
    assert cache.num_blocks_used == 4
    # the two free blocks plus the reused ones: everything can be handed out again
    cache.prepare_forward([4], [16])
    assert sorted(cache.block_tables[4]) == [0, 1, 6, 7]
    assert cache.num_blocks_used == 8


def test_exhaustion_raises_clear_error():
    cache = small_cache(num_blocks=3, block_size=4)
    cache.prepare_forward([0], [8])
    with pytest.raises(CacheExhaustedError) as info:
        cache.prepare_forward([1], [5])
    message = str(info.value)
    assert "exhausted" in message and "num_kv_blocks" in message
    assert "2 more blocks needed, 1 of 3 free" in message
    assert issubclass(CacheExhaustedError, RuntimeError)
    # the row that fit keeps its blocks; freeing it makes room again
    assert cache.block_tables[0] == [0, 1]
    cache.free_row(0)
    cache.prepare_forward([2], [12])
    assert len(cache.block_tables[2]) == 3


def test_exhaustion_on_growth():
    cache = small_cache(num_blocks=2, block_size=4)
    cache.prepare_forward([0], [8])
    with pytest.raises(CacheExhaustedError):
        cache.prepare_forward([0], [1])


def test_crop_is_refused():
    with pytest.raises(NotImplementedError, match="rollback"):
        small_cache().crop(3)


def test_cache_needs_paged_metadata():
    cache = small_cache()
    with pytest.raises(RuntimeError, match="paged_metadata"):
        cache.layers[0].update(
            torch.zeros(1, NUM_KV_HEADS, 1, HEAD_DIM), torch.zeros(1, NUM_KV_HEADS, 1, HEAD_DIM)
        )


# --- forwards through the paged cache ----------------------------------------------------------


def paged_forward(
    model, cache: PagedKVCache, rows: list[int], segments: list[list[int]]
) -> list[torch.Tensor]:
    """One packed forward of each row's new tokens, as step.speculative_step does it; logits per row."""
    counts = [len(s) for s in segments]
    starts = [cache.seq_lens.get(row, 0) for row in rows]
    meta = cache.prepare_forward(rows, counts)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
    with torch.no_grad(), use_paged_attention(model):
        logits = model(
            input_ids=torch.tensor([t for s in segments for t in s])[None],
            position_ids=positions[None],
            cache=cache,
            use_cache=True,
            paged_metadata=meta,
        ).logits[0]
    return list(logits.split(counts))


def plain_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens)[None]).logits[0]


def test_use_paged_attention_restores_implementation(tiny_llama):
    before = tiny_llama.config._attn_implementation
    with use_paged_attention(tiny_llama):
        assert tiny_llama.config._attn_implementation == ATTENTION_NAME
    assert tiny_llama.config._attn_implementation == before
    with pytest.raises(KeyError), use_paged_attention(tiny_llama):
        raise KeyError("boom")
    assert tiny_llama.config._attn_implementation == before


def test_packed_two_rows_match_separate_plain_forwards(tiny_llama):
    model = tiny_llama
    cache = PagedKVCache.for_model(model, num_blocks=32, block_size=4)
    a = [5, 9, 17, 5, 9, 17, 40]
    b = [60, 61, 62, 63, 60, 61, 62, 63, 60, 61, 70]
    # prefill: two rows of different lengths in one packed forward
    out_a, out_b = paged_forward(model, cache, [0, 1], [a, b])
    torch.testing.assert_close(out_a, plain_logits(model, a), atol=1e-5, rtol=0)
    torch.testing.assert_close(out_b, plain_logits(model, b), atol=1e-5, rtol=0)

    # verify-style step: several new tokens per row, ragged
    a_step, b_step = [11, 12, 13], [14, 15]
    out_a, out_b = paged_forward(model, cache, [0, 1], [a_step, b_step])
    torch.testing.assert_close(out_a, plain_logits(model, a + a_step)[-3:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out_b, plain_logits(model, b + b_step)[-2:], atol=1e-5, rtol=0)

    # reject: row 0 keeps one of its three new tokens, row 1 none; then forward other tokens
    cache.rollback(0, len(a) + 1)
    cache.rollback(1, len(b))
    a_kept, b_kept = a + a_step[:1], b
    a_next, b_next = [90, 91], [92, 93, 94, 95]
    out_a, out_b = paged_forward(model, cache, [0, 1], [a_next, b_next])
    torch.testing.assert_close(out_a, plain_logits(model, a_kept + a_next)[-2:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out_b, plain_logits(model, b_kept + b_next)[-4:], atol=1e-5, rtol=0)
    assert cache.seq_lens == {0: len(a_kept) + 2, 1: len(b_kept) + 4}

    # one row only, single-token decode
    (out_b,) = paged_forward(model, cache, [1], [[7]])
    torch.testing.assert_close(out_b, plain_logits(model, b_kept + b_next + [7])[-1:], atol=1e-5, rtol=0)


def test_single_row_with_scattered_blocks(tiny_llama):
    """A row whose blocks are not consecutive in the pool (gather path) after another row was freed."""
    model = tiny_llama
    cache = PagedKVCache.for_model(model, num_blocks=16, block_size=4)
    first = [3, 4, 5, 6, 7, 8, 9, 10]
    paged_forward(model, cache, [0, 1], [first, [20, 21, 22, 23]])  # row 0: blocks 0-1, row 1: block 2
    cache.free_row(0)
    tokens = list(range(30, 42))
    (out,) = paged_forward(model, cache, [2], [tokens])  # blocks 0, 1, 3
    assert cache.block_tables[2] == [0, 1, 3]
    torch.testing.assert_close(out, plain_logits(model, tokens), atol=1e-5, rtol=0)
    (out,) = paged_forward(model, cache, [2], [[50, 51]])  # grows into block 4: [0, 1, 3, 4]
    torch.testing.assert_close(out, plain_logits(model, tokens + [50, 51])[-2:], atol=1e-5, rtol=0)
    # the surviving row was not disturbed by the reuse of row 0's blocks
    (out,) = paged_forward(model, cache, [1], [[24]])
    torch.testing.assert_close(out, plain_logits(model, [20, 21, 22, 23, 24])[-1:], atol=1e-5, rtol=0)


def test_generate_raises_when_kv_pool_too_small():
    model = hf_specdec.enable(build_tiny_llama())
    prompt = list(range(3, 23))  # 20 tokens > 2 blocks of 4
    inputs = {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, 20, dtype=torch.long)}
    before = model.config._attn_implementation
    with pytest.raises(CacheExhaustedError, match="num_kv_blocks"):
        model.generate(
            **inputs,
            max_new_tokens=10,
            do_sample=False,
            speculative_config=ngram_config(num_kv_blocks=2, block_size=4),
        )
    # the model is left as it was: plain generate and a well-sized pool still work
    assert model.config._attn_implementation == before
    plain = plain_generate(model, **inputs, max_new_tokens=10, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=10,
        do_sample=False,
        speculative_config=ngram_config(num_kv_blocks=8, block_size=4),
    )
    assert torch.equal(out, plain)


@pytest.mark.parametrize("block_size", (1, 4, 16))
def test_generate_with_small_blocks_and_exact_pool(block_size):
    """Rows finishing early free their blocks: a pool sized to the request is enough, any block size."""
    model = hf_specdec.enable(build_tiny_llama())
    inputs = repeated_span_batch(3)
    plain = plain_generate(model, **inputs, max_new_tokens=30, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=30,
        do_sample=False,
        speculative_config=ngram_config(5, block_size=block_size),
    )
    assert torch.equal(out, plain)


def test_generate_returns_every_block(monkeypatch):
    """Rows that finish (EOS at different steps, or max_new_tokens) hand their blocks back."""
    from hf_specdec.loop import engine

    caches = []
    original = engine.PagedKVCache.for_model

    def capture(*args, **kwargs):
        caches.append(original(*args, **kwargs))
        return caches[-1]

    monkeypatch.setattr(engine.PagedKVCache, "for_model", capture)
    model = hf_specdec.enable(build_tiny_llama())
    inputs = repeated_span_batch(4)
    width = inputs["input_ids"].shape[1]
    first = plain_generate(model, **inputs, max_new_tokens=30, do_sample=False)[0, width:].tolist()
    eos = next(t for i, t in enumerate(first) if i >= 5 and t not in first[:i])
    out = model.generate(
        **inputs,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=eos,
        speculative_config=ngram_config(5, block_size=4),
    )
    assert (out[:, width:] == 0).any(), "no row finished early"
    cache = caches[-1]  # the loop's (the first is the architecture probe's scratch cache)
    assert cache.num_blocks_used == 0
    assert cache.block_tables == {} and cache.seq_lens == {}
