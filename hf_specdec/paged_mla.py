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
from transformers.cache_utils import Cache

from .paged_cache import BlockAllocator, PagedAttentionMetadata, PagedKVCache, PagedLayer


def is_mla(config) -> bool:
    """Whether a (text) config describes multi-head latent attention."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (
        getattr(config, "kv_lora_rank", None) is not None
        and getattr(config, "qk_rope_head_dim", None) is not None
    )


def gather_rows(pool: torch.Tensor, meta: PagedAttentionMetadata, name: str) -> torch.Tensor:
    """Each row's slots of `pool` `[blocks, block_size, heads, dim]` as `[rows, heads, S, dim]`."""
    num_heads, dim = pool.shape[-2:]
    if meta.contiguous_kv is not None:  # one row, consecutive blocks: a view, no copy
        start, length = meta.contiguous_kv
        return pool.view(-1, num_heads, dim)[start : start + length][None].transpose(1, 2)
    num_rows, num_blocks = meta.block_table.shape
    buffer = meta.scratch.get(name)
    if buffer is None:
        buffer = meta.scratch[name] = pool.new_empty((num_rows * num_blocks, *pool.shape[1:]))
    torch.index_select(pool, 0, meta.block_table.view(-1), out=buffer)
    return buffer.view(num_rows, -1, num_heads, dim).transpose(1, 2)


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

        Cache.__init__(
            self,
            layers=[PagedLatentLayer(pool(kv_lora_rank), pool(qk_rope_head_dim)) for _ in range(num_layers)],
        )
        self.block_size = block_size
        self.device = torch.device(device)
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, num_blocks: int, block_size: int = 16, num_layers: int | None = None
    ) -> PagedMLACache:
        config = model.config.get_text_config()
        return cls(
            num_layers=num_layers or config.num_hidden_layers,
            kv_lora_rank=config.kv_lora_rank,
            qk_rope_head_dim=config.qk_rope_head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=model.dtype,
            device=model.device,
        )

    def prepare_forward(self, rows: list[int], num_new_tokens: list[int]) -> PagedAttentionMetadata:
        metadata = super().prepare_forward(rows, num_new_tokens)
        metadata.kv_gathered = True  # the attention function gets keys / values per row, not the pool
        return metadata
