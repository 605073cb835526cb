"""Attention over the paged KV cache, registered through transformers' `AttentionInterface`.

The model is called with packed tokens (`[1, num_tokens]`, every row's new tokens one after
another) and a `paged_metadata` kwarg that transformers forwards to the attention function.
`PagedLayer.update` has already written the new keys / values into the pool and hands the pool
to us as `key` / `value`.

Portable path (CPU, and CUDA without flash-attn): scatter the packed queries into a padded
`[rows, max_query_len]` batch, gather each row's keys / values from its blocks, and run
PyTorch's SDPA with the causal-within-the-draft-span mask the metadata carries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, PreTrainedModel

from .paged_cache import PagedAttentionMetadata

ATTENTION_NAME = "hf_specdec_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    paged_metadata: PagedAttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query `[1, heads, tokens, dim]`; key / value: the layer's pools `[blocks, block_size, kv_heads, dim]`.

    Returns `[1, tokens, heads, dim]`, as transformers' attention functions do.
    """
    if paged_metadata is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' needs `paged_metadata` (it runs only inside hf_specdec)")
    meta = paged_metadata
    num_rows, max_query_len = meta.query_valid.shape
    if meta.kv_gathered:  # MLA: per-row keys / values [rows, heads, S, dim]; values may be narrower
        num_kv_heads, head_dim = key.shape[1], query.shape[-1]
    else:
        num_kv_heads, head_dim = key.shape[-2:]
    if meta.query_index is None:  # one row: the packed layout is already [1, heads, tokens, dim]
        queries = query
    else:
        queries = query[0].transpose(0, 1).index_select(0, meta.query_index)
        queries = queries.view(num_rows, max_query_len, -1, head_dim).transpose(1, 2)

    if meta.kv_gathered:
        keys, values = key, value
    else:
        keys, values = gather_rows(key, meta, "keys"), gather_rows(value, meta, "values")
    out = torch.nn.functional.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=meta.attn_mask,
        scale=scaling,
        enable_gqa=num_kv_heads != queries.shape[1],
    )
    out = out.transpose(1, 2)  # [rows, max_q, heads, dim]
    if meta.query_index is None:
        return out, None
    return out[meta.query_valid].unsqueeze(0), None


def gather_rows(pool: torch.Tensor, meta: PagedAttentionMetadata, name: str) -> torch.Tensor:
    """Each row's slots of `pool` `[blocks, block_size, heads, dim]` as `[rows, heads, S, dim]`.

    One row with consecutive blocks: a view of the pool, S = its length. Otherwise each row's
    blocks side by side, S = max blocks x block size, copied into the buffer `name` of the
    forward's scratch, which every layer reuses (allocating a fresh one per layer costs more
    than the copy on CPU).
    """
    num_heads, dim = pool.shape[-2:]
    if meta.contiguous_kv is not None:
        start, length = meta.contiguous_kv
        return pool.view(-1, num_heads, dim)[start : start + length][None].transpose(1, 2)
    num_rows, num_blocks = meta.block_table.shape
    buffer = meta.scratch.get(name)
    if buffer is None:
        buffer = meta.scratch[name] = pool.new_empty((num_rows * num_blocks, *pool.shape[1:]))
    torch.index_select(pool, 0, meta.block_table.view(-1), out=buffer)
    return buffer.view(num_rows, -1, num_heads, dim).transpose(1, 2)


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@contextlib.contextmanager
def use_paged_attention(model: PreTrainedModel) -> Iterator[None]:
    """Route the model's attention through the paged function for the duration of the block.

    The previous implementation comes back afterwards, so plain `generate()` is untouched.
    """
    configs = [model.config]
    text_config = model.config.get_text_config()
    if text_config is not model.config:
        configs.append(text_config)
    previous = [config._attn_implementation for config in configs]
    try:
        for config in configs:
            config._attn_implementation = ATTENTION_NAME
        yield
    finally:
        for config, name in zip(configs, previous):
            config._attn_implementation = name
