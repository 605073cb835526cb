"""Paged static KV cache: a preallocated pool of fixed-size blocks per layer, a block table and
a length per row (seed §12.3.4).

Why not transformers' own `PagedAttentionCache`: it belongs to the continuous-batching manager
(sectors, schedulers, request states) and is not a `Cache`, so a model's `forward(cache=...)`
cannot take it. This is a `Cache` subclass the model's attention layers write into directly.

- Writes: each forward carries a `slot_mapping` (pool slot of every new token); the layer's
  `update` copies the new keys / values there and hands the whole pool to the attention function.
- Rollback of rejected draft positions only lowers a row's length: nothing is copied or erased,
  the stale slots are simply overwritten by the next forward.
- Blocks come from one free list shared by every row; a finished row gives its blocks back.
  The pool is `torch.zeros`, whose pages the OS commits only when first written, and blocks are
  handed out lowest id first, so resident memory follows the tokens actually held.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class CacheExhaustedError(RuntimeError):
    """The KV block pool has no free block left for a row that needs one."""


class BlockAllocator:
    """Free list of block ids; lowest id first so the touched part of the pool stays compact."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise CacheExhaustedError(
                f"KV cache exhausted: {count} more blocks needed, {len(self._free)} of {self.num_blocks} free. "
                "Raise speculative_config.num_kv_blocks (or leave it None to size the pool from the request)."
            )
        return [heapq.heappop(self._free) for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            heapq.heappush(self._free, block_id)


@dataclass
class PagedAttentionMetadata:
    """Where one forward's tokens go and what each of them may attend to.

    The forward's tokens are packed: `[1, num_tokens]`, row after row (varlen, seed §12.3.3).
    """

    slot_mapping: torch.Tensor  # [num_tokens] pool slot written by each new token
    query_start_loc: torch.Tensor  # [num_rows + 1] cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # [num_rows] tokens held per row once this forward is written
    block_table: torch.Tensor  # [num_rows, max_blocks] block ids, padded with 0
    # The portable (SDPA) path reads the pool through these: queries scattered into a padded
    # [num_rows, max_query_len] layout, each row's blocks gathered, a causal mask over them.
    query_index: torch.Tensor | None  # [num_rows * max_query_len] index into the packed tokens; None: one row
    query_valid: torch.Tensor  # [num_rows, max_query_len] bool
    attn_mask: torch.Tensor | None  # [num_rows, 1, max_query_len, max_blocks * block_size] bool, True = attend
    # One row whose blocks are consecutive in the pool (the usual case at batch size 1, since
    # blocks are handed out lowest id first): (first slot, length) lets attention read the pool
    # in place instead of gathering.
    contiguous_kv: tuple[int, int] | None = None
    # MLA caches (paged_mla.py) hand attention each row's keys / values already gathered,
    # [rows, heads, S, dim], instead of the pool
    kv_gathered: bool = False
    # gather buffers, allocated by the first layer and reused by the others
    scratch: dict = field(default_factory=dict)


class PagedLayer(CacheLayerMixin):
    """One decoder layer's key / value pools, `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    is_sliding = False

    def __init__(self, key_pool: torch.Tensor, value_pool: torch.Tensor):
        super().__init__()
        self.keys, self.values = key_pool, value_pool
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the pools are allocated up front

    def update(self, key_states, value_states, *args, kwargs=None, **extra):
        metadata = (kwargs or {}).get("paged_metadata") or extra.get("paged_metadata")
        if metadata is None:
            raise RuntimeError("PagedKVCache needs `paged_metadata` in the forward kwargs (use hf_specdec's generate)")
        num_heads, head_dim = self.keys.shape[-2:]
        flat_keys = self.keys.view(-1, num_heads, head_dim)
        flat_values = self.values.view(-1, num_heads, head_dim)
        # [1, heads, tokens, dim] -> [tokens, heads, dim]
        flat_keys.index_copy_(0, metadata.slot_mapping, key_states[0].transpose(0, 1).to(flat_keys.dtype))
        flat_values.index_copy_(0, metadata.slot_mapping, value_states[0].transpose(0, 1).to(flat_values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0  # lengths are per row: see PagedKVCache.seq_lens

    def get_max_length(self) -> int:
        return -1


class PagedKVCache(Cache):
    """A transformers `Cache` of fixed-size blocks with a block table and a length per row.

    Rows are addressed by their index in the generate batch. Use `prepare_forward` before each
    model forward (it allocates blocks and returns the attention metadata), `rollback` after
    verification and `free_row` when a row finishes.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        layers = [
            PagedLayer(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        super().__init__(layers=layers)
        self._init_block_tables(num_blocks, block_size, device)

    def _init_block_tables(self, num_blocks: int, block_size: int, device: torch.device | str) -> None:
        """The bookkeeping of a paged cache, whatever its layers hold (`PagedMLACache` shares it)."""
        self.block_size = block_size
        self.device = torch.device(device)
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, num_blocks: int, block_size: int = 16, num_layers: int | None = None
    ) -> PagedKVCache:
        """A pool for `model`'s attention layers, in its dtype and on its device (MLA models: `PagedMLACache`)."""
        config = model.config.get_text_config()
        if cls is PagedKVCache and getattr(config, "kv_lora_rank", None) is not None:
            from .paged_mla import PagedMLACache  # MLA (DeepSeek) caches latents: paged_mla.py

            cls = PagedMLACache
        return cls(
            num_layers=num_layers or config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=model.dtype,
            device=model.device,
            **cls._pool_widths(config),
        )

    @staticmethod
    def _pool_widths(config) -> dict[str, int]:
        """The constructor's per-token pool widths for a (text) config: KV heads and head dim."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return {"num_kv_heads": num_kv_heads, "head_dim": head_dim}

    # --- bookkeeping ---------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_tokens_held(self) -> int:
        return sum(self.seq_lens.values())

    def blocks_needed(self, tokens_per_row: Iterable[int]) -> int:
        """Blocks that rows holding these many tokens need at the least."""
        return int(sum(self.blocks_for(int(n)) for n in tokens_per_row))

    @property
    def num_blocks_used(self) -> int:
        return self.allocator.num_used

    def _reserve(self, row: int, num_tokens: int) -> list[int]:
        table = self.block_tables.setdefault(row, [])
        self.seq_lens.setdefault(row, 0)
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > 0:
            table.extend(self.allocator.allocate(missing))
        return table

    def rollback(self, row: int, num_tokens: int) -> None:
        """Keep the first `num_tokens` of the row; later slots are stale and get overwritten."""
        if num_tokens > self.seq_lens.get(row, 0):
            raise ValueError(f"cannot roll row {row} forward to {num_tokens} tokens (holds {self.seq_lens.get(row, 0)})")
        self.seq_lens[row] = num_tokens
        table = self.block_tables.setdefault(row, [])
        keep = self.blocks_for(num_tokens)
        if len(table) > keep:
            self.allocator.free(table[keep:])
            del table[keep:]

    def free_row(self, row: int) -> None:
        self.allocator.free(self.block_tables.pop(row, []))
        self.seq_lens.pop(row, None)

    # --- one forward ---------------------------------------------------------------------------
    def prepare_forward(self, rows: list[int], num_new_tokens: list[int]) -> PagedAttentionMetadata:
        """Reserve room for each row's new tokens and describe the packed forward."""
        block_size = self.block_size
        context_lens = np.array([self.seq_lens.get(row, 0) for row in rows], dtype=np.int64)
        new_lens = np.asarray(num_new_tokens, dtype=np.int64)
        seq_lens = context_lens + new_lens
        tables = [self._reserve(row, int(length)) for row, length in zip(rows, seq_lens)]
        for row, length in zip(rows, seq_lens):
            self.seq_lens[row] = int(length)

        num_rows, max_query_len = len(rows), int(new_lens.max())
        block_table = np.zeros((num_rows, max(len(t) for t in tables)), dtype=np.int64)
        for i, table in enumerate(tables):
            block_table[i, : len(table)] = table

        positions = np.arange(block_table.shape[1] * block_size)  # key positions of the gathered blocks
        query_start_loc = np.concatenate([[0], np.cumsum(new_lens)])
        query_offsets = np.arange(max_query_len)
        query_valid = query_offsets[None, :] < new_lens[:, None]
        query_index = np.where(query_valid, query_start_loc[:-1, None] + query_offsets[None, :], 0)
        query_positions = context_lens[:, None] + query_offsets[None, :]  # absolute position of each query
        valid_rows, valid_positions = np.nonzero(query_valid)[0], query_positions[query_valid]
        slot_mapping = block_table[valid_rows, valid_positions // block_size] * block_size + valid_positions % block_size

        attn_mask = positions[None, None, :] <= query_positions[:, :, None]
        attn_mask[~query_valid] = False
        attn_mask[..., 0] = True  # padded queries attend somewhere, so softmax never sees an empty row

        contiguous_kv = None
        if num_rows == 1 and np.all(np.diff(tables[0]) == 1):
            contiguous_kv = (tables[0][0] * block_size, int(seq_lens[0]))
            attn_mask = None if max_query_len == 1 else attn_mask[:, :, : seq_lens[0]]

        def as_tensor(array: np.ndarray | None) -> torch.Tensor | None:
            return None if array is None else torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

        return PagedAttentionMetadata(
            slot_mapping=as_tensor(slot_mapping),
            query_start_loc=as_tensor(query_start_loc),
            seq_lens=as_tensor(seq_lens),
            block_table=as_tensor(block_table),
            query_index=None if num_rows == 1 else as_tensor(query_index.reshape(-1)),
            query_valid=as_tensor(query_valid),
            attn_mask=None if attn_mask is None else as_tensor(attn_mask[:, None]),
            contiguous_kv=contiguous_kv,
        )

    # --- the parts of the Cache API transformers calls ------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.seq_lens.values(), default=0)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("PagedKVCache rolls back per row: use rollback(row, num_tokens)")
