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
    num_kv_heads, head_dim = key.shape[-2:]
    packed_queries = query[0].transpose(0, 1)  # [tokens, heads, dim]
    queries = packed_queries[meta.query_index].transpose(1, 2)  # [rows, heads, max_q, dim]
    keys = key.view(-1, num_kv_heads, head_dim)[meta.kv_slots].transpose(1, 2)  # [rows, kv_heads, max_kv, dim]
    values = value.view(-1, num_kv_heads, head_dim)[meta.kv_slots].transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=meta.attn_mask,
        scale=scaling,
        enable_gqa=keys.shape[1] != queries.shape[1],
    )
    out = out.transpose(1, 2)[meta.query_valid]  # [tokens, heads, dim], packed again
    return out.unsqueeze(0), None


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
