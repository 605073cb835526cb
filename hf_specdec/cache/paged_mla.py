"""Paged KV cache for multi-head latent attention (MLA: DeepSeek-V2 / V3 and their MTP layers).

transformers' MLA caches the *compressed latents*, not keys and values: each layer calls
`cache.update(kv_latent [1, 1, T, kv_lora_rank], k_rope [1, 1, T, qk_rope_head_dim])`, then
expands whatever the cache returns with `kv_b_proj` into keys (qk_nope + qk_rope dims) and values
(v_head_dim: another size) for every head, and only then calls the attention function.

So an MLA layer cannot be handed the whole pool as `PagedLayer` does (the expansion would run over
every slot of the pool, and the result is no longer in block layout). `PagedLatentLayer` stores
the two latents in block pools (one "head" each, two different widths), and its `update` returns
each row's latents already gathered, `[rows, 1, S, dim]` (a view of the pool when the forward has
a single row with contiguous blocks, S = its length; else a copy of the rows' blocks, S = max
blocks x block size, into a buffer every layer reuses). The model expands them per row, and the
attention function receives keys / values in that gathered layout: `PagedMLACache` marks its
metadata `kv_gathered`, and `paged_attention_forward` then skips its own gather and applies the
same mask. The latents are what is cached (kv_lora_rank + qk_rope_head_dim numbers per token and
layer), so the pool is as small as transformers' own MLA cache; the expansion per forward is the
same work transformers' DynamicCache path does.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from .paged_attention import gather_rows
from .paged_cache import PagedAttentionMetadata, PagedKVCache, PagedLayer


def is_mla(config: PretrainedConfig) -> bool:
    """Whether a (text) config describes multi-head latent attention."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (
        getattr(config, "kv_lora_rank", None) is not None
        and getattr(config, "qk_rope_head_dim", None) is not None
    )


class PagedLatentLayer(PagedLayer):
    """One MLA layer's latent pools: `[blocks, block_size, 1, kv_lora_rank]` and `[..., 1, qk_rope_head_dim]`."""

    def update(self, key_states, value_states, *args, kwargs=None, **extra):
        metadata = (kwargs or {}).get("paged_metadata") or extra.get("paged_metadata")
        if metadata is None:
            raise RuntimeError(
                "PagedMLACache needs `paged_metadata` in the forward kwargs (use hf_specdec's generate)"
            )
        # the two latents have different widths: each pool is flattened on its own
        for pool, new in ((self.keys, key_states), (self.values, value_states)):
            flat = pool.view(-1, *pool.shape[-2:])
            flat.index_copy_(0, metadata.slot_mapping, new[0].transpose(0, 1).to(flat.dtype))
        return gather_rows(self.keys, metadata, "latent_keys"), gather_rows(
            self.values, metadata, "latent_values"
        )


class PagedMLACache(PagedKVCache):
    """`PagedKVCache` whose layers hold MLA latents; same block tables, lengths and rollback."""

    def __init__(
        self,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        def pool(width: int) -> torch.Tensor:
            return torch.zeros((num_blocks, block_size, 1, width), dtype=dtype, device=device)

        # PagedKVCache.__init__ would allocate key / value pools: build the latent layers instead
        Cache.__init__(
            self,
            layers=[PagedLatentLayer(pool(kv_lora_rank), pool(qk_rope_head_dim)) for _ in range(num_layers)],
        )
        self._init_block_tables(num_blocks, block_size, device)

    @staticmethod
    def _pool_widths(config) -> dict[str, int]:
        return {"kv_lora_rank": config.kv_lora_rank, "qk_rope_head_dim": config.qk_rope_head_dim}

    def prepare_forward(self, rows: list[int], num_new_tokens: list[int]) -> PagedAttentionMetadata:
        metadata = super().prepare_forward(rows, num_new_tokens)
        metadata.kv_gathered = True  # the attention function gets keys / values per row, not the pool
        return metadata
