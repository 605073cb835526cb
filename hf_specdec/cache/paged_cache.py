"""Paged static KV cache: a preallocated pool of fixed-size blocks per layer, a block table and
a length per row (seed §12.3.4).

Why not transformers' own `PagedAttentionCache`: it belongs to the continuous-batching manager
(sectors, schedulers, request states) and is not a `Cache`, so a model's `forward(cache=...)`
cannot take it. This is a `Cache` subclass the model's attention layers write into directly.

- Writes: `prepare_forward` describes the next forward (`PagedAttentionMetadata`: the pool slot of
  every new token, block tables, lengths); the layer's `update` copies the new keys / values there
  and hands the whole pool to the attention function, with that metadata (`active_metadata`).
- Pools are shaped by the first write of each layer (heads and head size come from the key /
  value states the layer hands over), so layers of one model may differ: per-layer head sizes,
  keys and values of different widths, MLA latents.
- Rollback of rejected draft positions only lowers a row's length: nothing is copied or erased,
  the stale slots are simply overwritten by the next forward.
- Blocks come from one free list shared by every row; a finished row gives its blocks back.
  The pool is `torch.zeros`, whose pages the OS commits only when first written, and blocks are
  handed out lowest id first, so resident memory follows the tokens actually held.

Multi-head latent attention (MLA: DeepSeek-V2 / V3, their MTP layers, and the families built like
them) caches the compressed latents, not keys and values: each layer calls
`cache.update(kv_latent [1, 1, T, kv_lora_rank], k_rope [1, 1, T, qk_rope_head_dim])`, then expands
whatever the cache returns with `kv_b_proj` into per-head keys and values before attention. Such a
layer cannot be handed the whole pool (the expansion would run over every slot), so a cache built
with `gathered=True` returns each row's latents already gathered, `[rows, 1, S, dim]`, and marks its
metadata `kv_gathered`: the attention function then reads keys / values in that layout.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from ..transfer import to_device
from .recurrent import RECURRENT_AND_ATTENTION_LAYER_TYPES, RECURRENT_LAYER_TYPES, RecurrentStates

# The metadata of the forward in progress, published by each cache write for the attention function
# that follows it: models that do not forward their kwargs to the cache or to attention (GPT-NeoX
# calls `update(k, v, layer_idx)` bare) still reach the paged path. A ContextVar, so threads and
# tasks running forwards of their own never see each other's.
_ACTIVE_METADATA: ContextVar = ContextVar("hf_specdec_paged_metadata", default=None)


def active_metadata() -> PagedAttentionMetadata | None:
    """The metadata of the last cache write in this thread / task (None before any)."""
    return _ACTIVE_METADATA.get()


class UnsupportedMaskError(ValueError):
    """The model's mask function cannot be evaluated at packed rows' positions."""


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


# layer types (transformers' `layer_types`) the paged cache holds: attention the paged path
# reproduces, and the recurrent / convolution states `recurrent.py` rolls back
SUPPORTED_LAYER_TYPES = (
    "full_attention", "sliding_attention", "chunked_attention", "indexed_attention",
    *RECURRENT_LAYER_TYPES, *RECURRENT_AND_ATTENTION_LAYER_TYPES,
)  # fmt: skip
# layer types without any attention or cache (their layers need no pool)
NO_CACHE_LAYER_TYPES = ("moe", "mlp")

class UnsupportedModelError(ValueError):
    """hf_specdec cannot speculate on this model exactly; the message names the model type and why."""


def layer_attention(config) -> list[tuple[str, int | None]]:
    """Per decoder layer, its kind and size: ("full", None), ("sliding", window), ("chunked", chunk),
    ("recurrent", None) for a recurrent / convolution state (`recurrent.py`), ("recurrent+attention",
    window) for a layer holding both (Zamba, Falcon-H1), ("reuse", None) for a layer attending to an
    earlier layer's cache (`kv_sharing_modes`), ("indexed", None) for sparse attention over the keys an
    indexer selects (DeepSeek-V3.2), ("none", None) for a layer without attention; raises
    `UnsupportedModelError` for a layer type not implemented here.

    Read through transformers' own `get_layer_types_and_kwargs`, the function that shapes its
    `DynamicCache`, so a layer is treated here as transformers' cache treats it.
    """
    text = config.get_text_config()
    model_type = getattr(text, "model_type", None)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    sharing = getattr(text, "kv_sharing_modes", None) or [None] * len(layer_types)
    kinds = []
    for index, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        if sharing[index] in ("reuse", "reuse_but_indexer"):  # the latter keeps indexer keys of its own (Mistral Large 4)
            # Gemma 3n / Gemma 4: the layer attends to the keys / values an earlier layer's cache write
            # returned (its whole pool, here) and writes none of its own
            kinds.append(("reuse", None))
        elif layer_type in NO_CACHE_LAYER_TYPES or layer_type == "dummy":
            kinds.append(("none", None))
        elif layer_type == "full_attention":
            kinds.append(("full", None))
        elif layer_type == "sliding_attention":
            kinds.append(("sliding", int(kwargs["sliding_window"])))
        elif layer_type == "chunked_attention":
            kinds.append(("chunked", int(kwargs["sliding_window"])))
        elif layer_type == "indexed_attention":
            kinds.append(("indexed", None))
        elif layer_type in RECURRENT_LAYER_TYPES:
            kinds.append(("recurrent", None))
        elif layer_type in RECURRENT_AND_ATTENTION_LAYER_TYPES:
            kinds.append(("recurrent+attention", kwargs.get("sliding_window")))
        else:
            raise UnsupportedModelError(
                f"model_type={model_type!r} is not supported: layer {index} is {layer_type!r}: an attention kind "
                f"the paged attention does not implement; supported layer types: {', '.join(SUPPORTED_LAYER_TYPES)}"
            )
    return kinds


def recurrent_states_for(config, max_rollback: int) -> RecurrentStates | None:
    """The per-row recurrent states of a hybrid model's config; None when it has no recurrent layer."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config())
    indices = [
        i for i, layer_type in enumerate(layer_types)
        if layer_type in RECURRENT_LAYER_TYPES or layer_type in RECURRENT_AND_ATTENTION_LAYER_TYPES
    ]
    if not indices:
        return None
    return RecurrentStates(
        {i: layer_types[i] for i in indices}, {i: layer_kwargs[i] for i in indices}, max_rollback=max_rollback
    )


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
    # [num_rows, max_query_len] layout, each row's keys gathered side by side (`gather_rows`).
    query_index: torch.Tensor | None  # [num_rows * max_query_len] index into the packed tokens; None: one row
    query_valid: torch.Tensor  # [num_rows, max_query_len] bool
    query_positions: torch.Tensor  # [num_rows, max_query_len] each query's index in its row (its position)
    key_span: int  # S: keys per row in the gathered layout (key j of a row is its token j)
    max_seq_len: int = 0  # max of seq_lens, known on the host (the kernel sizes its launch by it)
    # [num_rows, max_query_len, T] bool for drafts laid out as trees: the row's last T keys (its new
    # tokens, after some of its context for rows with fewer new tokens; a drafter's own tree
    # entries) are seen by new token a iff tree_mask[row, a, t] for key seq_len - T + t; keys before
    # them stay visible. None: the new tokens are a chain (causal).
    tree_mask: torch.Tensor | None = None
    # One row whose blocks are consecutive in the pool (the usual case at batch size 1, since
    # blocks are handed out lowest id first): (first slot, length) lets attention read the pool
    # in place instead of gathering.
    contiguous_kv: tuple[int, int] | None = None
    # MLA caches hand attention each row's keys / values already gathered, [rows, heads, S, dim]
    kv_gathered: bool = False
    # one row of a model with sparse indexed attention: its indexer reads the layer's mask as a tensor
    # (`ModelMask.__getitem__`)
    indexed: bool = False
    # gather buffers and masks, built by the first layer that needs them and reused by the others
    scratch: dict = field(default_factory=dict)

    def attention_mask(self, mask_function: Callable | None = None) -> torch.Tensor | None:
        """`[rows, 1, max_query_len, S]` bool (True = attend), or None when every key may be seen.

        `mask_function`: the index function transformers' `masking_utils` composed for the layer
        (causal, and the sliding-window, chunk or other overlays the model asked for), evaluated at
        each row's own query and key positions; None: causal. Keys past a row's length never count.
        Built once per forward and function, shared by every layer that uses it.
        """
        num_rows, max_query_len = self.query_valid.shape
        key = ("mask", mask_function)
        if key in self.scratch:
            return self.scratch[key]
        queries = self.query_positions[:, None, :, None]  # [rows, 1, q, 1]
        keys = torch.arange(self.key_span, device=queries.device)[None, None, None, :]
        if mask_function is None:
            if max_query_len == 1 and num_rows == 1 and self.contiguous_kv is not None:
                self.scratch[key] = None  # one query reading exactly its row's keys: nothing to hide
                return None
            mask = keys <= queries
        else:
            rows = torch.zeros((num_rows, 1, 1, 1), dtype=torch.long, device=queries.device)
            heads = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=queries.device)
            try:
                mask = mask_function(rows, heads, queries, keys).expand(num_rows, 1, max_query_len, self.key_span)
            except IndexError as error:  # it indexes per-batch tensors (padding, token types) by position
                raise UnsupportedMaskError(
                    "the mask the model builds reads inputs laid out by batch row and position (padding, token "
                    f"types) that the packed varlen layout does not have ({error})"
                ) from error
            mask = mask & (keys < self.seq_lens[:, None, None, None])
        if self.tree_mask is not None:
            mask = self._with_tree(mask, keys)
        mask = mask & self.query_valid[:, None, :, None]
        mask[..., 0] |= ~self.query_valid[:, None, :]  # padded queries attend somewhere: no empty softmax
        self.scratch[key] = mask
        return mask

    def _with_tree(self, mask: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """`mask` with each row's last T keys decided by `tree_mask` instead."""
        num_rows, max_query_len = self.query_valid.shape
        span = self.tree_mask.shape[-1]
        offset = keys - (self.seq_lens - span)[:, None, None, None]  # [rows, 1, 1, S]: index among the last T
        is_new = (offset >= 0) & (keys < self.seq_lens[:, None, None, None])
        index = offset.clamp(0, span - 1).expand(num_rows, 1, max_query_len, self.key_span)
        tree = torch.gather(self.tree_mask[:, None], 3, index)
        return torch.where(is_new, tree, mask)

    def count(self, event: str) -> None:
        """Tally a per-forward event ("cache_writes", "attention_calls"): the architecture probe reads them."""
        self.scratch[event] = self.scratch.get(event, 0) + 1


class PagedLayer(CacheLayerMixin):
    """One decoder layer's key / value pools, `[num_blocks, block_size, heads, dim]` each,
    allocated at the layer's first write from the shapes, dtype and device of its states."""

    is_sliding = False

    def __init__(self, num_blocks: int, block_size: int, gathered: bool = False):
        super().__init__()
        self.num_blocks, self.block_size, self.gathered = num_blocks, block_size, gathered
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.indexer_keys: torch.Tensor | None = None  # sparse indexed attention's own keys (`update_indexer`)
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        def pool(states: torch.Tensor) -> torch.Tensor:  # states [1, heads, tokens, dim]
            shape = (self.num_blocks, self.block_size, states.shape[1], states.shape[-1])
            return torch.zeros(shape, dtype=states.dtype, device=states.device)

        self.keys, self.values = pool(key_states), pool(value_states)
        # each pool as [slots, heads, dim], made once for writes without grad (the loop's): two view ops a write
        # cost ~8 us a layer on a CPU. torch forbids writing through a view made without grad while grad is on
        with torch.no_grad():
            self.slots = (slots_view(self.keys), slots_view(self.values))
        self.is_initialized = True

    def update_indexer(self, key_states: torch.Tensor, metadata: PagedAttentionMetadata) -> torch.Tensor:
        """Sparse indexed attention (DeepSeek-V3.2): write the indexer's keys `[1, tokens, dim]` at the
        forward's slots, in a pool of their own, and return the row's, `[1, S, dim]` (key j: token j)."""
        if self.indexer_keys is None:
            shape = (self.num_blocks, self.block_size, 1, key_states.shape[-1])
            self.indexer_keys = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
        flat = slots_view(self.indexer_keys)
        flat.index_copy_(0, metadata.slot_mapping, key_states[0, :, None].to(flat.dtype))
        return gather_rows(self.indexer_keys, metadata, "indexer_keys")[:, 0]

    def update(self, key_states, value_states, *args, kwargs=None, metadata=None, **extra):
        metadata = metadata or (kwargs or {}).get("paged_metadata") or extra.get("paged_metadata")
        if metadata is None:
            raise RuntimeError("PagedKVCache needs `paged_metadata` in the forward kwargs (use hf_specdec's generate)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        metadata.count("cache_writes")
        _ACTIVE_METADATA.set(metadata)
        # keys and values may differ in width (MLA latents): each pool is flattened on its own
        slots = (slots_view(self.keys), slots_view(self.values)) if torch.is_grad_enabled() else self.slots
        for flat, new in zip(slots, (key_states, value_states)):
            new = new[0].transpose(0, 1)  # [1, heads, tokens, dim] -> [tokens, heads, dim]
            flat.index_copy_(0, metadata.slot_mapping, new if new.dtype == flat.dtype else new.to(flat.dtype))
        if self.gathered:
            return gather_rows(self.keys, metadata, "keys"), gather_rows(self.values, metadata, "values")
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0  # lengths are per row: see PagedKVCache.seq_lens

    def get_max_length(self) -> int:
        return -1


def slots_view(pool: torch.Tensor) -> torch.Tensor:
    """`[blocks, block_size, heads, dim]` as `[slots, heads, dim]` (sized explicitly: Mistral Large 4's
    no-RoPE layers cache zero-width rotary keys, which a -1 cannot size)."""
    return pool.view(pool.shape[0] * pool.shape[1], *pool.shape[2:])


def gather_rows(pool: torch.Tensor, meta: PagedAttentionMetadata, name: str) -> torch.Tensor:
    """Each row's slots of `pool` `[blocks, block_size, heads, dim]` as `[rows, heads, S, dim]`.

    One row with consecutive blocks: a view of the pool, S = its length. Otherwise each row's
    blocks side by side, S = max blocks x block size, copied into the buffer `name` of the
    forward's scratch, which every layer with pools of that shape reuses (allocating a fresh one
    per layer costs more than the copy on CPU).
    """
    num_heads, dim = pool.shape[-2:]
    if meta.contiguous_kv is not None:
        start, length = meta.contiguous_kv
        # one strided view: four chained view ops cost 13 us a layer on a CPU, twice a layer; a pool the model
        # handed on sliced (not contiguous) takes the chained views, which keep its strides
        if pool.is_contiguous():
            offset = pool.storage_offset() + start * num_heads * dim
            return pool.as_strided((1, num_heads, length, dim), (length * num_heads * dim, dim, num_heads * dim, 1), offset)
        return slots_view(pool)[start : start + length][None].transpose(1, 2)
    num_rows, num_blocks = meta.block_table.shape
    shape = (num_rows * num_blocks, *pool.shape[1:])
    buffer = meta.scratch.get((name, shape, pool.dtype, pool.device))
    if buffer is None:
        buffer = meta.scratch[(name, shape, pool.dtype, pool.device)] = pool.new_empty(shape)
    torch.index_select(pool, 0, meta.block_table.view(-1).to(pool.device), out=buffer)
    return buffer.view(num_rows, num_blocks * pool.shape[1], num_heads, dim).transpose(1, 2)


def is_mla(config: PretrainedConfig) -> bool:
    """Whether a config describes multi-head latent attention (its layers cache latents, not K / V)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    # heterogeneous configs (dots.3: its sliding layers have MLA sizes of their own) refuse a global read
    layers = config.per_layer_config if getattr(config, "per_layer_config", None) else [config]
    return any(
        getattr(layer, "kv_lora_rank", None) is not None and getattr(layer, "qk_rope_head_dim", None) is not None
        for layer in layers
    )


class PagedKVCache(Cache):
    """A transformers `Cache` of fixed-size blocks with a block table and a length per row.

    Rows are addressed by their index in the generate batch. Use `prepare_forward` before each
    model forward (it allocates blocks and returns the attention metadata), `rollback` after
    verification and `free_row` when a row finishes.

    `num_kv_heads` / `head_dim` allocate every layer's pools up front (dtype, device); left None,
    each layer's pools take their shape from its first write. `gathered`: MLA layers (see the
    module docstring). `layer_kinds`: what each layer holds (`layer_attention`; the architecture
    probe counts the attention layers); the masks come from the model itself (`paged_attention.py`). `recurrent`: the
    per-row states of a hybrid model's recurrent layers (`recurrent.py`); such a cache takes one row
    per forward (`one_row_per_forward`, `forward.run_rows`).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        num_blocks: int = 0,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        gathered: bool = False,
        layer_kinds: list[tuple[str, int | None]] | None = None,
        recurrent: RecurrentStates | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"PagedKVCache needs num_blocks >= 1, got {num_blocks}")
        layers = [PagedLayer(num_blocks, block_size, gathered) for _ in range(num_layers)]
        if recurrent is not None:  # placeholders: each row's own layer objects go here before its forward
            recurrent.attention = {index: layers[index] for index in recurrent.layer_types}
            for index in recurrent.layer_types:
                layers[index] = recurrent.new_layer(index)
        if num_kv_heads is not None and head_dim is not None:
            states = torch.zeros((1, num_kv_heads, 0, head_dim), dtype=dtype, device=device)
            for layer in layers:
                layer.lazy_initialization(states, states)
        super().__init__(layers=layers)
        self.gathered = gathered
        self.layer_kinds = layer_kinds
        self.recurrent = recurrent
        self.block_size = block_size
        self.device = torch.device(device)
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}
        self.forward_metadata: PagedAttentionMetadata | None = None  # of the last prepare_forward

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int = 16,
        num_layers: int | None = None,
        max_rollback: int = 32,
    ) -> PagedKVCache:
        """A pool for `model`'s attention layers, on its device (MLA models: latents, gathered), with
        each layer's attention kind, and per-row states for its recurrent layers that one rollback may
        take back by up to `max_rollback` tokens; `UnsupportedModelError` for a layer type it cannot hold.
        A model that runs on its own attention (`own_attention.py`) gets an `OwnAttentionCache`."""
        config = model.config.get_text_config()
        from .own_attention import own_attention_cache, runs_own_attention  # it subclasses this one

        if runs_own_attention(model):
            return own_attention_cache(
                model, max_rollback, num_layers=num_layers or config.num_hidden_layers, num_blocks=num_blocks,
                block_size=block_size, device=model.device, layer_kinds=layer_attention(config),
            )  # fmt: skip
        return cls(
            num_layers=num_layers or config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            device=model.device,
            gathered=is_mla(config),
            layer_kinds=layer_attention(config),
            recurrent=recurrent_states_for(config, max_rollback),
        )

    # where a forward's tokens sit in the model's input: None, packed [1, tokens] (a batch of the model's
    # own lays them out [rows, width]: own_attention.BatchLayout)
    batch_layout = None

    @property
    def one_row_per_forward(self) -> bool:
        """Whether each forward must carry a single row: a hybrid model's recurrent layers (`recurrent.py`),
        or sparse indexed attention, whose indexer scores its queries against every key of the batch row
        it is handed (all rows' keys, packed)."""
        return self.recurrent is not None or self.indexed

    @property
    def rollback_reach(self) -> int | None:
        """How many tokens one rollback may take back at most (recurrent states record that much); None: any."""
        return self.recurrent.max_rollback if self.recurrent is not None else None

    @property
    def indexed(self) -> bool:
        return any(kind == "indexed" for kind, _ in self.layer_kinds or ())

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
        if self.recurrent is not None:
            self.recurrent.rollback(row, num_tokens)
        self.seq_lens[row] = num_tokens
        table = self.block_tables.setdefault(row, [])
        keep = self.blocks_for(num_tokens)
        if len(table) > keep:
            self.allocator.free(table[keep:])
            del table[keep:]

    def free_row(self, row: int) -> None:
        self.allocator.free(self.block_tables.pop(row, []))
        self.seq_lens.pop(row, None)
        if self.recurrent is not None:
            self.recurrent.free(row)

    # --- one forward ---------------------------------------------------------------------------
    def prepare_forward(
        self, rows: list[int], num_new_tokens: list[int], tree_mask: np.ndarray | None = None
    ) -> PagedAttentionMetadata:
        """Reserve room for each row's new tokens and describe the packed forward (`tree_mask`:
        `PagedAttentionMetadata.tree_mask`, for drafts laid out as trees)."""
        if self.one_row_per_forward and len(rows) != 1:
            raise RuntimeError("a cache with recurrent or indexed layers takes one row per forward (forward.run_rows)")
        if self.recurrent is not None:
            for index, layer in self.recurrent.layers_of(rows[0]).items():
                self.layers[index] = layer
        context_lens = np.array([self.seq_lens.get(row, 0) for row in rows], dtype=np.int64)
        new_lens = np.asarray(num_new_tokens, dtype=np.int64)
        seq_lens = context_lens + new_lens
        tables = [self._reserve(row, int(length)) for row, length in zip(rows, seq_lens)]
        for row, length in zip(rows, seq_lens):
            self.seq_lens[row] = int(length)
        self.forward_metadata = self._describe(tables, context_lens, new_lens, seq_lens, tree_mask)
        self.forward_metadata.indexed = self.indexed
        return self.forward_metadata

    def describe_reads(self, rows: list[int]) -> PagedAttentionMetadata:
        """A forward of one query per row that reads the row's held keys and writes nothing (a drafter
        attending to the target's cache: Gemma 4's assistant). Masks see the query at the row's last
        held position, as the last query of a forward that wrote it (so the kernel's convention holds);
        the positions the model's rotary embedding takes are the caller's. The rows keep their lengths."""
        held = np.array([self.seq_lens[row] for row in rows], dtype=np.int64)
        return self._describe([self.block_tables[row] for row in rows], held - 1, np.ones_like(held), held, None, writes=False)

    def _describe(
        self,
        tables: list[list[int]],
        context_lens: np.ndarray,
        new_lens: np.ndarray,
        seq_lens: np.ndarray,
        tree_mask: np.ndarray | None,
        writes: bool = True,
    ) -> PagedAttentionMetadata:
        """The metadata of a packed forward of `new_lens` queries per row at positions `context_lens`..,
        over `seq_lens` keys per row (`writes`: each query's key goes to its slot)."""
        block_size = self.block_size
        num_rows, max_query_len = len(tables), int(new_lens.max())
        block_table = np.zeros((num_rows, max(len(t) for t in tables)), dtype=np.int64)
        for i, table in enumerate(tables):
            block_table[i, : len(table)] = table

        query_start_loc = np.concatenate([[0], np.cumsum(new_lens)])
        query_offsets = np.arange(max_query_len)
        query_valid = query_offsets[None, :] < new_lens[:, None]
        query_index = np.where(query_valid, query_start_loc[:-1, None] + query_offsets[None, :], 0)
        query_positions = context_lens[:, None] + query_offsets[None, :]
        slot_mapping = np.zeros(0, dtype=np.int64)
        if writes:
            valid_rows, valid_positions = np.nonzero(query_valid)[0], query_positions[query_valid]
            slot_mapping = block_table[valid_rows, valid_positions // block_size] * block_size + valid_positions % block_size

        contiguous_kv = None
        key_span = block_table.shape[1] * block_size
        if num_rows == 1 and np.all(np.diff(tables[0]) == 1):
            contiguous_kv = (tables[0][0] * block_size, int(seq_lens[0]))
            key_span = int(seq_lens[0])

        slot_mapping, query_start_loc, seq_lens_t, block_table_t, query_index_t, query_valid, query_positions = to_device(
            [slot_mapping, query_start_loc, seq_lens, block_table, query_index.reshape(-1), query_valid, query_positions],
            self.device,
        )
        return PagedAttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_t,
            block_table=block_table_t,
            query_index=None if num_rows == 1 else query_index_t,
            query_valid=query_valid,
            query_positions=query_positions,
            key_span=key_span,
            max_seq_len=int(seq_lens.max()),
            contiguous_kv=contiguous_kv,
            kv_gathered=self.gathered,
            tree_mask=None if tree_mask is None else to_device([tree_mask], self.device)[0],
        )

    def move_tokens(self, moves: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        """For each (row, from, to): the K/V of the row's tokens at positions `from` go to positions
        `to` (every layer; all moves read before any is written). A draft tree's accepted path moves
        into place this way, its nodes' K/V having been written at their slots in the tree."""
        moves = [(row, src, dst) for row, src, dst in moves if not np.array_equal(src, dst)]
        if not moves:
            return
        source, target = (
            to_device([np.concatenate([self._slots(row, positions[i]) for row, *positions in moves])], self.device)[0]
            for i in (0, 1)
        )
        for layer in self.layers:
            for pool in (getattr(layer, "keys", None), getattr(layer, "values", None), getattr(layer, "indexer_keys", None)):
                if pool is not None:
                    flat = slots_view(pool)
                    flat.index_copy_(0, target, flat.index_select(0, source))

    def _slots(self, row: int, positions: np.ndarray) -> np.ndarray:
        table = np.asarray(self.block_tables[row], dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    # --- the parts of the Cache API transformers calls ------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write a layer's new keys / values where the last `prepare_forward` placed them (a
        `paged_metadata` in the layer's kwargs takes precedence)."""
        given = (kwargs.get("kwargs") or {}).get("paged_metadata") or kwargs.get("paged_metadata")
        metadata = given or self.forward_metadata
        return self.layers[layer_idx].update(key_states, value_states, metadata=metadata)

    def update_indexer(self, key_states: torch.Tensor, layer_idx: int, *args, **kwargs) -> torch.Tensor:
        """The indexer keys of a sparse indexed attention layer, written and read as `PagedLayer.update_indexer`."""
        return self.layers[layer_idx].update_indexer(key_states, active_metadata() or self.forward_metadata)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.seq_lens.values(), default=0)

    def model_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """The model's forward inputs for the prepared forward's tokens `input_ids` at `position_ids` (`[1, tokens]`,
        or laid out by row): them and this cache (an `OwnAttentionCache` hands the row's own)."""
        return {"input_ids": input_ids, "position_ids": position_ids, "cache": self}

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("PagedKVCache rolls back per row: use rollback(row, num_tokens)")

