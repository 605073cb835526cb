"""The model's own attention and cache, one row per forward: for models the paged attention cannot run exactly.

Some models compute attention themselves instead of calling transformers' `AttentionInterface`
(BLOOM, GPT-Neo, MPT and other ALiBi or hand-masked models), build masks from inputs laid out by
batch row (BERT-style decoders), hand their attention a bias (T5-style `position_bias`) or count
positions in ways the packed layout does not reproduce (DiffLlama). The paged path refuses them
(`architectures.py`). transformers' own assisted generation runs them at batch size 1 on the model's
`DynamicCache`, cropped after a rejection; this cache does the same for every row of a batch: each
row gets a `DynamicCache` built as plain `generate()` builds it (sliding layers included, recording
their past so they can be cropped back), the model runs one row per forward (no padding in it) with
its own attention and masks, and a rollback crops the row's layers.

The block bookkeeping of `PagedKVCache` is kept (block tables, lengths, the allocator), so the loop,
the engine's admission and its KV metrics are unchanged; the pools themselves are never written.
Slower than the paged path (one forward per row, the cache re-concatenated each step), and exact:
`architectures.py` checks that a row's logits on it equal the model's own forward, rollback included.
Draft trees are refused (the model builds its own causal mask), as are image prompts.
"""

from __future__ import annotations

import copy
import inspect
import weakref

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from .paged_cache import PagedAttentionMetadata, PagedKVCache

# models `architectures.py` found exact on this cache and not on the paged path (kept per model object)
_OWN_ATTENTION_MODELS: weakref.WeakSet = weakref.WeakSet()


def runs_own_attention(model: torch.nn.Module) -> bool:
    """Whether the loop runs `model` on its own attention and `DynamicCache` (`OwnAttentionCache`)."""
    return model in _OWN_ATTENTION_MODELS


def mark_own_attention(model: torch.nn.Module) -> None:
    _OWN_ATTENTION_MODELS.add(model)


def generate_passes_position_ids(model: torch.nn.Module) -> bool:
    """Whether plain generate() hands the model's forward position ids: it counts them from 0 for every forward
    that takes them unless the model's `prepare_inputs_for_generation` drops them (Kosmos-2 / 2.5 count their own,
    from the padding id and the cache length)."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return False
    ids = torch.zeros((1, 2), dtype=torch.long, device=model.device)
    prepared = model.prepare_inputs_for_generation(
        ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(2, device=model.device)[None], use_cache=False,
        is_first_iteration=True,
    )  # fmt: skip
    return prepared.get("position_ids") is not None


class OwnAttentionCache(PagedKVCache):
    """`PagedKVCache`'s bookkeeping, with a transformers `DynamicCache` per row that the model itself
    reads and writes; `model_inputs()` hands the model the one of the row the last `prepare_forward` prepared."""

    def __init__(self, model: torch.nn.Module, max_rollback: int, **kwargs):
        super().__init__(**kwargs)
        # what plain generate() builds for the model (`_prepare_cache_for_generation`), with every layer that would
        # drop tokens (sliding windows, recurrent states) keeping them until `crop`, as assisted generation does;
        # each row gets a copy of it, made now: layer_skip cuts the model's layers while it drafts
        self._empty_cache = DynamicCache(config=model.config)
        self._empty_cache.activate_past_recording(recurrent_states_to_keep=max_rollback + 1)
        # a recurrent layer keeps the states of a forward's last `max_rollback + 1` tokens (the model hands them)
        records_states = any(hasattr(layer, "recurrent_states_history") for layer in self._empty_cache.layers)
        self._rollback_reach = max_rollback if records_states else None
        self.row_caches: dict[int, DynamicCache] = {}
        self._active_row: int | None = None
        self._settled: set[int] = set()  # rows rolled back since their last forward
        # the model counts a row's positions itself where plain generate() leaves them to it
        self._own_positions = {} if generate_passes_position_ids(model) else {"position_ids": None}

    @property
    def one_row_per_forward(self) -> bool:
        return True

    @property
    def rollback_reach(self) -> int | None:
        return self._rollback_reach

    def _row_cache(self, row: int) -> DynamicCache:
        cache = self.row_caches.get(row)
        if cache is None:
            cache = self.row_caches[row] = copy.deepcopy(self._empty_cache)
        return cache

    def prepare_forward(
        self, rows: list[int], num_new_tokens: list[int], tree_mask: np.ndarray | None = None
    ) -> PagedAttentionMetadata:
        if len(rows) != 1:
            raise RuntimeError("OwnAttentionCache takes one row per forward (forward.run_rows)")
        if tree_mask is not None:
            raise ValueError(
                "draft trees are not supported on models that run on their own attention (they build their own causal mask)"
            )
        row = rows[0]
        cache = self._row_cache(row)
        held = self.seq_lens.get(row, 0)
        settled = row in self._settled
        self._settled.discard(row)
        # Each layer back to what the row holds. layer_skip's drafts run (and write) the first layers only, so a
        # later layer may hold fewer: the drafts do not read it, and the verify writes it from `held` on. A crop
        # also lets a sliding or recurrent layer that records its past drop what no rollback can reach any more:
        # nothing below a rollback's target (`settled`), so crop(0) only there (a drafter's several forwards
        # may be rolled back together).
        for layer in cache.layers:
            length = int(layer.get_seq_length()) if hasattr(layer, "get_seq_length") else 0  # (placeholder layers)
            if length > held or (length and settled):
                layer.crop(-max(length - held, 0))
        self._active_row = row
        return super().prepare_forward(rows, num_new_tokens)

    def model_inputs(self) -> dict:
        """The row's own cache, and the attention mask plain generate() hands the model (no padding in a row alone);
        no position ids where plain generate() hands none."""
        if self._active_row is None:
            raise RuntimeError("OwnAttentionCache: prepare_forward a row before the forward")
        length = self.seq_lens[self._active_row]
        mask = torch.ones((1, length), dtype=torch.long, device=self.device)
        return {"cache": self.row_caches[self._active_row], "attention_mask": mask, **self._own_positions}

    def rollback(self, row: int, num_tokens: int) -> None:
        """As `PagedKVCache.rollback`; the row's own layers are cropped at its next forward. The loop never
        rolls a row back below a target it rolled it back to before (accepted tokens stay accepted)."""
        super().rollback(row, num_tokens)
        self._settled.add(row)

    def free_row(self, row: int) -> None:
        super().free_row(row)
        self.row_caches.pop(row, None)
        self._settled.discard(row)
        if self._active_row == row:
            self._active_row = None

    def move_tokens(self, moves: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        if any(not np.array_equal(src, dst) for _, src, dst in moves):
            raise ValueError("OwnAttentionCache cannot move tokens (draft trees are not supported on it)")

    def describe_reads(self, rows: list[int]) -> PagedAttentionMetadata:
        raise ValueError("a drafter reading the target's KV pools (Gemma 4's assistant) needs the paged attention")
