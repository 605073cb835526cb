"""The model's own attention and cache: for models the paged attention cannot run exactly.

Some models compute attention themselves instead of calling transformers' `AttentionInterface`
(BLOOM, GPT-Neo, MPT and other ALiBi or hand-masked models), build masks from inputs laid out by
batch row (BERT-style decoders), hand their attention a bias (T5-style `position_bias`) or count
positions in ways the packed layout does not reproduce (DiffLlama). The paged path refuses them
(`architectures.py`). transformers' own assisted generation runs them at batch size 1 on the model's
`DynamicCache`, cropped after a rejection. Two caches here do it for a batch:

- `BatchedOwnAttentionCache`, where every cache layer is a plain `DynamicLayer` (BLOOM, GPT-Neo, MPT,
  XGLM...): one `DynamicCache` for the whole batch, laid out as plain `generate()` lays out a
  left-padded batch, so one forward serves every row. Rows accept different numbers of drafts, so
  before each forward every layer is realigned (one gather: each row's kept keys end at the same
  column, left padding before them); the new tokens of rows with fewer of them are padded on the
  right, where no real query sees them, and dropped by the next realignment.
- `RowOwnAttentionCache` otherwise (sliding windows, recurrent layers, and models whose plain
  `generate()` reads a padded row differently): a `DynamicCache` per row, recording its past so that
  sliding and recurrent layers can be cropped back, one row per forward (no padding in it).
- `EncoderDecoderBatchedCache` / `EncoderDecoderRowCache` for an encoder-decoder model's decoder: the two
  above, plus the rows' encoder output and cross-attention cache (batched where the probe finds it exact:
  every row's positions its own, which BART-style decoders get from `_positions_by_row`).

Both keep `PagedKVCache`'s block bookkeeping (block tables, lengths, the allocator), so the loop, the
engine's admission and its KV metrics are unchanged; the pools themselves are never written. Exact:
`architectures.py` checks that rows fed in pieces on them give the model's own logits, rollback
included. Draft trees are refused (the model builds its own causal mask), as are image prompts.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.utils import ModelOutput

from ..transfer import to_device
from .paged_cache import PagedAttentionMetadata, PagedKVCache

# models `architectures.py` found exact on these caches and not on the paged path (kept per model object),
# and those of them found exact batched
_OWN_ATTENTION_MODELS: weakref.WeakSet = weakref.WeakSet()
_BATCHED_MODELS: weakref.WeakSet = weakref.WeakSet()


def runs_own_attention(model: torch.nn.Module) -> bool:
    """Whether the loop runs `model` on its own attention and `DynamicCache` (`OwnAttentionCache`)."""
    return model in _OWN_ATTENTION_MODELS


def runs_one_row_per_forward(model: torch.nn.Module) -> bool:
    """Whether the model runs on its own attention one row per forward (`RowOwnAttentionCache`)."""
    return model in _OWN_ATTENTION_MODELS and model not in _BATCHED_MODELS


def mark_own_attention(model: torch.nn.Module, batched: bool = False) -> None:
    _OWN_ATTENTION_MODELS.add(model)
    if batched:
        _BATCHED_MODELS.add(model)
    else:
        _BATCHED_MODELS.discard(model)


def own_attention_cache(model: torch.nn.Module, max_rollback: int, **kwargs) -> OwnAttentionCache:
    """The cache a model marked by `mark_own_attention` runs on (`kwargs`: `PagedKVCache`'s)."""
    one_row = runs_one_row_per_forward(model)
    if model.config.is_encoder_decoder:
        cache_class = EncoderDecoderRowCache if one_row else EncoderDecoderBatchedCache
    else:
        cache_class = RowOwnAttentionCache if one_row else BatchedOwnAttentionCache
    return cache_class(model, max_rollback, **kwargs)


def batches_plainly(model: torch.nn.Module) -> bool:
    """Whether every layer of the `DynamicCache` plain generate() builds for `model` is a plain `DynamicLayer`
    (what `BatchedOwnAttentionCache` realigns)."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


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
    """What both own-attention caches share: the `DynamicCache` plain generate() builds for the model, with
    every layer that would drop tokens (sliding windows, recurrent states) keeping them until `crop`, as
    assisted generation does; no draft trees, no reads of the pools."""

    def __init__(self, model: torch.nn.Module, max_rollback: int, **kwargs):
        super().__init__(**kwargs)
        # made now: layer_skip cuts the model's layers while it drafts
        self._empty_cache = DynamicCache(config=model.config)
        self._empty_cache.activate_past_recording(recurrent_states_to_keep=max_rollback + 1)
        # a recurrent layer keeps the states of a forward's last `max_rollback + 1` tokens (the model hands them)
        records_states = any(hasattr(layer, "recurrent_states_history") for layer in self._empty_cache.layers)
        self._rollback_reach = max_rollback if records_states else None
        # the model counts a row's positions itself where plain generate() leaves them to it (an encoder-decoder
        # model's decoder always: generate() computes no positions for those)
        passes_positions = not model.config.is_encoder_decoder and generate_passes_position_ids(model)
        self._own_positions = {} if passes_positions else {"position_ids": None}

    @property
    def rollback_reach(self) -> int | None:
        return self._rollback_reach

    @staticmethod
    def _refuse_trees(tree_mask: np.ndarray | None) -> None:
        if tree_mask is not None:
            raise ValueError(
                "draft trees are not supported on models that run on their own attention (they build their own causal mask)"
            )

    def move_tokens(self, moves: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        if any(not np.array_equal(src, dst) for _, src, dst in moves):
            raise ValueError("OwnAttentionCache cannot move tokens (draft trees are not supported on it)")

    def describe_reads(self, rows: list[int]) -> PagedAttentionMetadata:
        raise ValueError("a drafter reading the target's KV pools (Gemma 4's assistant) needs the paged attention")


class RowOwnAttentionCache(OwnAttentionCache):
    """A transformers `DynamicCache` per row that the model itself reads and writes; `model_inputs()` hands the
    model the one of the row the last `prepare_forward` prepared."""

    def __init__(self, model: torch.nn.Module, max_rollback: int, **kwargs):
        super().__init__(model, max_rollback, **kwargs)
        self.row_caches: dict[int, DynamicCache] = {}
        self._active_row: int | None = None
        self._settled: set[int] = set()  # rows rolled back since their last forward

    @property
    def one_row_per_forward(self) -> bool:
        return True

    def _row_cache(self, row: int) -> DynamicCache:
        cache = self.row_caches.get(row)
        if cache is None:
            cache = self.row_caches[row] = copy.deepcopy(self._empty_cache)
        return cache

    def prepare_forward(
        self, rows: list[int], num_new_tokens: list[int], tree_mask: np.ndarray | None = None
    ) -> PagedAttentionMetadata:
        if len(rows) != 1:
            raise RuntimeError("RowOwnAttentionCache takes one row per forward (forward.run_rows)")
        self._refuse_trees(tree_mask)
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

    def model_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """The row's own cache, and the attention mask plain generate() hands the model (no padding in a row alone);
        no position ids where plain generate() hands none."""
        row = self._prepared_row()
        mask = torch.ones((1, self.seq_lens[row]), dtype=torch.long, device=self.device)
        return {
            "input_ids": input_ids, "position_ids": position_ids, "cache": self.row_caches[row], "attention_mask": mask,
            **self._own_positions,
        }  # fmt: skip

    def _prepared_row(self) -> int:
        if self._active_row is None:
            raise RuntimeError("OwnAttentionCache: prepare_forward a row before the forward")
        return self._active_row

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


class EncoderDecoderRowCache(RowOwnAttentionCache):
    """An encoder-decoder model's decoder (BART, T5, Marian, Whisper...), one row per forward. Each row's
    self-attention cache is `RowOwnAttentionCache`'s; its cross-attention keys and values, which the row's first
    forward computes from its encoder states and no rollback touches, sit in a `DynamicCache` of their own, the
    two handed over as the `EncoderDecoderCache` plain generate() builds. Every forward gets the row's encoder
    states and the encoder's attention mask (`set_encoder_states`), and its decoder positions count from the
    cache, as in plain generate() (which hands such a decoder no positions)."""

    def __init__(self, model: torch.nn.Module, max_rollback: int, **kwargs):
        super().__init__(model, max_rollback, **kwargs)
        # no config: a layer that slides over its own keys attends to every encoder state (as transformers'
        # encoder-decoders build their cross-attention caches)
        self._empty_cross_cache = DynamicCache()
        self._encoder_states: dict[int, tuple[Any, torch.Tensor | None]] = {}
        self._cross_caches: dict[int, DynamicCache] = {}

    def set_encoder_states(self, rows: Sequence[int], encoder_outputs: Any, attention_mask: torch.Tensor | None) -> None:
        """The encoder output for `rows` (what the model's encoder returns, a batch in that order) and the encoder's
        attention mask over it (`[len(rows), source length]`; None: no padding), before their first forward."""
        for index, row in enumerate(rows):
            row_mask = None if attention_mask is None else attention_mask[index : index + 1]
            self._encoder_states[row] = (encoder_rows(encoder_outputs, [index], len(rows)), row_mask)
            self._cross_caches[row] = copy.deepcopy(self._empty_cross_cache)

    def model_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict:
        row = self._prepared_row()
        if row not in self._encoder_states:
            raise RuntimeError(f"EncoderDecoderRowCache: row {row} has no encoder states (set_encoder_states)")
        encoder_outputs, attention_mask = self._encoder_states[row]
        return {
            "decoder_input_ids": input_ids, "encoder_outputs": encoder_outputs, "attention_mask": attention_mask,
            "cache": EncoderDecoderCache(self.row_caches[row], self._cross_caches[row]),
        }  # fmt: skip

    def free_row(self, row: int) -> None:
        super().free_row(row)
        self._encoder_states.pop(row, None)
        self._cross_caches.pop(row, None)


def encoder_input_name(model: torch.nn.Module) -> str:
    """What an encoder-decoder model's encoder reads (`input_ids`, `input_features`...): its own main input, as
    generate() names it (a speech encoder-decoder's `inputs` are its encoder's `input_values`)."""
    return getattr(model.get_encoder(), "main_input_name", model.main_input_name)


def encoder_token_embeddings(encoder: torch.nn.Module) -> torch.nn.Module:
    """An encoder's token embedding table (FSMT's encoder has `embed_tokens` but no get_input_embeddings)."""
    return getattr(encoder, "embed_tokens", None) or encoder.get_input_embeddings()


def encoder_rows(encoder_outputs: Any, indices: Sequence[int], batch_size: int) -> Any:
    """Rows `indices` of a batch's encoder output (a `ModelOutput`, or the tuple a caller passed), in that order:
    every tensor whose first dimension is the batch, indexed so, in the same container (fields such as MoE router
    logits or a downsampled mask, which some decoders read, come along)."""
    if isinstance(encoder_outputs, torch.Tensor):
        if not encoder_outputs.ndim or encoder_outputs.shape[0] != batch_size:
            return encoder_outputs
        if list(indices) == list(range(batch_size)):
            return encoder_outputs
        return encoder_outputs.index_select(0, torch.tensor(list(indices), device=encoder_outputs.device))
    if isinstance(encoder_outputs, ModelOutput):
        return type(encoder_outputs)(**{name: encoder_rows(value, indices, batch_size) for name, value in encoder_outputs.items()})
    if isinstance(encoder_outputs, (tuple, list)):
        return type(encoder_outputs)(encoder_rows(value, indices, batch_size) for value in encoder_outputs)
    return encoder_outputs


@dataclasses.dataclass
class BatchLayout:
    """Where a forward's packed tokens sit in the batched `[batch_size, width]` input: token i at
    (`slots[i]`, `columns[i]`), flat `positions[i]` (on the device); each row's new tokens from column 0,
    the rest padding."""

    slots: np.ndarray
    columns: np.ndarray
    batch_size: int
    width: int
    positions: torch.Tensor

    def scatter(self, packed: torch.Tensor) -> torch.Tensor:
        """`packed` `[num_tokens]` laid out `[batch_size, width]`, padding 0 (masked out: no real query sees it)."""
        batched = packed.new_zeros(self.batch_size * self.width)
        batched[self.positions] = packed
        return batched.view(self.batch_size, self.width)


class BatchedOwnAttentionCache(OwnAttentionCache):
    """One `DynamicCache` for the whole batch, every row in a slot of its batch dimension. Before each forward
    each layer is realigned so that every row's kept keys end at the same column (`width`, the most any row
    holds), as plain generate()'s left-padded batch; the forward appends `chunk` columns (each row's new
    tokens first, padding after them). A rollback only shortens the row's count: the next realignment
    drops what it no longer holds. A layer a forward did not run (layer_skip's drafts run the first
    layers) keeps what it held, and gets the rows' tokens again at the verify."""

    def __init__(self, model: torch.nn.Module, max_rollback: int, **kwargs):
        super().__init__(model, max_rollback, **kwargs)
        self.batch_cache = copy.deepcopy(self._empty_cache)
        num_layers = len(self.batch_cache.layers)
        self.slots: list[int | None] = []  # the row in each batch slot (None: free)
        self._slot_of: dict[int, int] = {}
        # [layer, slot]: the keys each slot holds in each layer, the column after its last one; each layer's width
        self._held = np.zeros((num_layers, 0), dtype=np.int64)
        self._ends = np.zeros((num_layers, 0), dtype=np.int64)
        self._widths = [0] * num_layers
        self._last_forward: tuple[np.ndarray, np.ndarray, int] | None = None  # (held, tokens each slot got, chunk)
        self._mask: torch.Tensor | None = None
        self.batch_layout: BatchLayout | None = None

    def prepare_forward(
        self, rows: list[int], num_new_tokens: list[int], tree_mask: np.ndarray | None = None
    ) -> PagedAttentionMetadata:
        self._refuse_trees(tree_mask)
        self._account_last_forward()
        self._assign_slots(rows)
        held = np.array([0 if row is None else self.seq_lens.get(row, 0) for row in self.slots], dtype=np.int64)
        width = int(held.max(initial=0))
        sources: dict = {}  # layers laid out alike (all of them, but for layer_skip's drafts) share one gather index
        for index, layer in enumerate(self.batch_cache.layers):
            self._realign(index, layer, held, width, sources)

        counts = np.asarray(num_new_tokens, dtype=np.int64)
        chunk = int(counts.max())
        row_slots = np.array([self._slot_of[row] for row in rows], dtype=np.int64)
        got = np.zeros(len(self.slots), dtype=np.int64)
        got[row_slots] = counts
        mask = np.zeros((len(self.slots), width + chunk), dtype=np.int64)
        mask[:, :width] = np.arange(width)[None, :] >= (width - held)[:, None]
        mask[:, width:] = np.arange(chunk)[None, :] < got[:, None]
        mask[(got == 0) & (held == 0), width:] = 1  # an empty slot's padding attends to itself, not to nothing (NaN)
        slots, columns = np.repeat(row_slots, counts), np.concatenate([np.arange(n) for n in counts])
        self._mask, positions = to_device([mask, slots * chunk + columns], self.device)
        self.batch_layout = BatchLayout(slots, columns, batch_size=len(self.slots), width=chunk, positions=positions)
        self._last_forward = (held, got, chunk)
        return super().prepare_forward(rows, num_new_tokens)

    def _assign_slots(self, rows: list[int]) -> None:
        for row in rows:
            if row not in self._slot_of:
                free = self.slots.index(None) if None in self.slots else len(self.slots)
                if free == len(self.slots):
                    self.slots.append(None)
                self.slots[free], self._slot_of[row] = row, free
        while self.slots and self.slots[-1] is None:  # the batch shrinks from its end
            self.slots.pop()
        if self._held.shape[1] != len(self.slots):
            grow = max(len(self.slots) - self._held.shape[1], 0)
            self._held = np.pad(self._held, ((0, 0), (0, grow)))[:, : len(self.slots)]
            self._ends = np.pad(self._ends, ((0, 0), (0, grow)))[:, : len(self.slots)]

    def _account_last_forward(self) -> None:
        """Each layer the last forward ran holds its rows' new tokens (padding after them)."""
        if self._last_forward is None:
            return
        held, got, chunk = self._last_forward
        self._last_forward = None
        # rows fed, still held (a row may end right after its verify); each new token right after all they held
        fed = (got > 0) & np.array([row is not None for row in self.slots], dtype=bool)
        for index, layer in enumerate(self.batch_cache.layers):
            width = int(layer.get_seq_length())
            if width == self._widths[index]:
                continue  # not run
            if width != self._widths[index] + chunk or np.any(self._held[index][fed] != held[fed]):
                raise RuntimeError(f"BatchedOwnAttentionCache: layer {index} ran on rows it did not hold whole")
            self._held[index] = np.where(fed, self._held[index] + got, self._held[index])
            self._ends[index] = np.where(fed, self._widths[index] + got, self._ends[index])
            self._widths[index] = width

    def _realign(self, index: int, layer, held: np.ndarray, width: int, sources: dict) -> None:
        """Layer `index` laid out for the next forward: each slot's first min(its keys, `held`) keys from
        column `width - held` on; one gather over the batch, or a crop where no slot moves. `sources`: the
        gather indices built for earlier layers of this forward, by their layout."""
        kept = np.minimum(self._held[index], held)
        ends = self._ends[index] - (self._held[index] - kept)
        target_ends = width - held + kept
        old_width = self._widths[index]
        old_batch = int(layer.keys.shape[0]) if old_width else 0
        if old_width == 0:  # never run yet (layer_skip's first drafts): it gets every row's tokens at the verify
            self._held[index], self._ends[index] = 0, 0
            return
        self._held[index], self._ends[index], self._widths[index] = kept, target_ends, width
        if old_batch == len(self.slots) and width <= old_width and np.array_equal(ends, target_ends):
            if width < old_width:
                layer.crop(width - old_width)
            return
        key = (layer.keys.device, old_batch, old_width, (ends - target_ends).tobytes())
        if key not in sources:
            columns = np.arange(width)[None, :]
            source = np.clip(ends[:, None] - target_ends[:, None] + columns, 0, old_width - 1)  # left padding: anything
            sources[key] = to_device([np.minimum(np.arange(len(self.slots)), old_batch - 1), source], layer.keys.device)
        slots, source = sources[key]
        for name in ("keys", "values"):
            states = getattr(layer, name).index_select(0, slots)
            index_ = source[:, None, :, None].expand(len(self.slots), states.shape[1], width, states.shape[3])
            setattr(layer, name, states.gather(2, index_))

    def forward_context(self) -> contextlib.AbstractContextManager:
        """What the prepared forward runs inside (`forward._batched_forward`): nothing here."""
        return contextlib.nullcontext()

    def model_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """The batch's cache and the attention mask of the prepared forward (left padding, each row's new tokens);
        no position ids where plain generate() hands none."""
        if self._mask is None:
            raise RuntimeError("BatchedOwnAttentionCache: prepare_forward before the forward")
        return {
            "input_ids": input_ids, "position_ids": position_ids, "cache": self.batch_cache, "attention_mask": self._mask,
            **self._own_positions,
        }  # fmt: skip

    def free_row(self, row: int) -> None:
        super().free_row(row)
        slot = self._slot_of.pop(row, None)
        if slot is not None:
            self.slots[slot] = None
            self._held[:, slot] = 0


class EncoderDecoderBatchedCache(BatchedOwnAttentionCache):
    """An encoder-decoder model's decoder with every row in one forward: `BatchedOwnAttentionCache`'s
    self-attention layout (left padding, realigned before each forward), and the encoder output, its mask and the
    cross-attention keys and values laid out by batch slot. Positions: a decoder that takes
    `decoder_position_ids` gets each row's own (Whisper); T5's relative bias reads only their differences; a
    BART-style decoder numbers a forward's tokens from the cache's width, which a row's left padding shifts, so
    its `embed_positions` is evaluated again row by row at the row's own length (`_positions_by_row`).
    `architectures.py` runs a model so only where this gives the model's own logits (the batched probe)."""

    def __init__(self, model: torch.nn.Module, max_rollback: int, **kwargs):
        super().__init__(model, max_rollback, **kwargs)
        self._passes_positions = "decoder_position_ids" in inspect.signature(model.forward).parameters
        # (SpeechT5's sits in its decoder's prenet)
        self._embed_positions = [
            module for name, module in model.get_decoder().named_modules() if name.split(".")[-1] == "embed_positions"
        ]  # fmt: skip
        self._cross_cache = DynamicCache()  # no config: see EncoderDecoderRowCache
        self._model = model  # a joining row's cross-attention keys come from a forward of its own (`_joining_keys`)
        # per row: its encoder output and mask, a batch of one (`set_encoder_states`); rows join at any time
        self._sources: dict[int, tuple[Any, torch.Tensor | None]] = {}
        self._slot_sources: list[tuple[Any, torch.Tensor | None]] = []  # what each slot's inputs and cross keys hold
        self._slot_encoder: tuple[Any, torch.Tensor | None] | None = None

    def set_encoder_states(self, rows: Sequence[int], encoder_outputs: Any, attention_mask: torch.Tensor | None) -> None:
        """As `EncoderDecoderRowCache.set_encoder_states`: `generate()`'s whole batch at once, or the engine's
        requests as they join (a source of another length is padded to the longest, its mask saying so)."""
        for index, row in enumerate(rows):
            row_mask = None if attention_mask is None else attention_mask[index : index + 1]
            self._sources[row] = (encoder_rows(encoder_outputs, [index], len(rows)), row_mask)

    def prepare_forward(
        self, rows: list[int], num_new_tokens: list[int], tree_mask: np.ndarray | None = None
    ) -> PagedAttentionMetadata:
        metadata = super().prepare_forward(rows, num_new_tokens, tree_mask)
        self._lay_out_encoder()
        return metadata

    def _lay_out_encoder(self) -> None:
        """The encoder output, its mask and the cross-attention keys by slot, where the slots changed (rows
        finished or joined). A free slot keeps what it held: its padding query reads something. The keys of the
        rows that stay are kept (past a narrower layout's width they held padding: dropped) and joining rows get
        theirs from a forward of their own (`_joining_keys`); all are computed again only where the layout widens
        (the rows that stay have no keys for the padding it adds) or every row is new."""
        missing = [row for row in self.slots if row is not None and row not in self._sources]
        if missing:
            raise RuntimeError(f"EncoderDecoderBatchedCache: rows {missing} have no encoder states (set_encoder_states)")
        laid_out = self._slot_sources
        sources = [
            self._sources[row] if row is not None else laid_out[slot] if slot < len(laid_out) else None
            for slot, row in enumerate(self.slots)
        ]  # fmt: skip
        sources = [next(s for s in sources if s is not None) if s is None else s for s in sources]
        if _same_sources(sources, laid_out):
            return
        old_width = None if self._slot_encoder is None else self._slot_encoder[0][0].shape[1]
        self._slot_encoder = _stack_sources(sources)
        self._slot_sources = sources
        width = self._slot_encoder[0][0].shape[1]
        old = [id(source[0]) for source in laid_out]
        computed = [layer for layer in self._cross_cache.layers if getattr(layer, "keys", None) is not None]
        joining = [slot for slot, source in enumerate(sources) if id(source[0]) not in old]
        # (the keys span the encoder states: a model that shortens them is left to compute its own)
        if not computed or {layer.keys.shape[-2] for layer in computed} != {old_width} or width > old_width or len(joining) == len(sources):
            self._cross_cache = DynamicCache()  # the next forward computes them from the slots' encoder states
            return
        fresh = self._joining_keys(joining) if joining else []
        at = {slot: len(old) + i for i, slot in enumerate(joining)}
        index = torch.tensor(
            [at[slot] if slot in at else old.index(id(source[0])) for slot, source in enumerate(sources)],
            device=computed[0].keys.device,
        )
        for layer_index, layer in enumerate(self._cross_cache.layers):
            if getattr(layer, "keys", None) is None:
                continue
            keys, values = layer.keys[..., :width, :], layer.values[..., :width, :]
            if fresh:
                keys, values = torch.cat([keys, fresh[layer_index][0]]), torch.cat([values, fresh[layer_index][1]])
            layer.keys, layer.values = keys.index_select(0, index), values.index_select(0, index)

    def _joining_keys(self, slots: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's cross-attention keys and values for these slots alone, over their encoder states
        as laid out (padded to the layout's width): a one-token decoder forward of theirs, its output dropped
        (the model's own code computes them, whatever its layers call their projections)."""
        encoder_outputs, mask = self._slot_encoder
        index = torch.tensor(slots, device=self._model.device)
        cross_cache = DynamicCache()
        with torch.no_grad():
            self._model(
                decoder_input_ids=torch.zeros((len(slots), 1), dtype=torch.long, device=self._model.device),
                encoder_outputs=encoder_rows(encoder_outputs, slots, len(self.slots)),
                attention_mask=None if mask is None else mask.index_select(0, index.to(mask.device)),
                cache=EncoderDecoderCache(DynamicCache(), cross_cache), use_cache=True,
            )  # fmt: skip
        return [(layer.keys, layer.values) for layer in cross_cache.layers]

    def free_row(self, row: int) -> None:
        super().free_row(row)
        self._sources.pop(row, None)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """While the prepared forward runs: the decoder's `embed_positions` (BART, Marian, Pegasus, M2M-100...)
        at each row's own length, where left padding shifts a row (`_positions_by_row`)."""
        if self._passes_positions or not self._embed_positions or self._last_forward is None:
            return contextlib.nullcontext()
        held = self._last_forward[0]
        if not (held != held.max(initial=0)).any():  # no row left-padded
            return contextlib.nullcontext()
        return _positions_by_row(self._embed_positions, int(held.max()), held)

    def model_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """The decoder's tokens and mask as `BatchedOwnAttentionCache` lays them out, the slots' encoder output
        and mask, and the row's own positions where the model takes them."""
        if self._mask is None or self._slot_encoder is None:
            raise RuntimeError("EncoderDecoderBatchedCache: prepare_forward before the forward")
        encoder_outputs, encoder_mask = self._slot_encoder
        positions = {"decoder_position_ids": position_ids} if self._passes_positions else {}
        return {
            "decoder_input_ids": input_ids, "decoder_attention_mask": self._mask, "encoder_outputs": encoder_outputs,
            "attention_mask": encoder_mask, "cache": EncoderDecoderCache(self.batch_cache, self._cross_cache), **positions,
        }  # fmt: skip


def _same_sources(sources: list[tuple[Any, Any]], others: list[tuple[Any, Any]]) -> bool:
    return len(sources) == len(others) and all(a[0] is b[0] for a, b in zip(sources, others))


def _stack_sources(sources: list[tuple[Any, torch.Tensor | None]]) -> tuple[Any, torch.Tensor | None]:
    """The rows' encoder outputs (batches of one) and masks as one batch, shorter ones padded at their end with
    zeros (masked out), as a tokenizer pads a batch of sources; no mask where none was given and none is padded."""
    outputs = _stack_padded([source[0] for source in sources])
    masks = [source[1] for source in sources]
    if all(mask is None for mask in masks) and len({source[0][0].shape[1] for source in sources}) == 1:
        return outputs, None
    masks = [
        torch.ones(source[0][0].shape[:2], dtype=torch.long, device=source[0][0].device) if mask is None else mask
        for source, mask in zip(sources, masks)
    ]  # fmt: skip
    return outputs, _stack_padded(masks)


def _stack_padded(values: list[Any]) -> Any:
    """`encoder_rows`' inverse over batches of one from several batches: every tensor concatenated, those that
    differ only in their second dimension (along the source: states, masks) padded at its end with zeros first."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if not first.ndim or first.shape[0] != 1:
            return first
        if first.ndim >= 2:
            width = max(value.shape[1] for value in values)
            values = [torch.nn.functional.pad(v, [0, 0] * (v.ndim - 2) + [0, width - v.shape[1]]) for v in values]
        if any(value.shape != values[0].shape for value in values):
            raise ValueError(f"encoder outputs of shapes {sorted({tuple(v.shape) for v in values})} do not stack into one batch")
        return torch.cat(values)
    if isinstance(first, ModelOutput):
        return type(first)(**{name: _stack_padded([value[name] for value in values]) for name in first.keys()})
    if isinstance(first, (tuple, list)):
        return type(first)(_stack_padded([value[i] for value in values]) for i in range(len(first)))
    return first


@contextlib.contextmanager
def _positions_by_row(modules: list[torch.nn.Module], width: int, held: np.ndarray):
    """A forward hook on a decoder's `embed_positions`: the module's own output again for each slot alone, at the
    slot's own length (`held[slot]`) instead of the cache's `width`. Such modules take the decoder's input (or its
    shape), the cache's length and, some, the position ids counted from it (`arange(new tokens) + width`, as
    `[n]` or `[n, 1]`); each is handed the slot's own. Why: a BART-style decoder gives the module the cache's
    length, one number for the batch, and takes no position ids."""
    batch = len(held)

    def for_slot(value: Any, slot: int, tokens: int) -> Any:
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            return int(held[slot]) if value == width else value
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and tuple(value.shape) in ((tokens,), (tokens, 1)):
            return value - (width - int(held[slot]))  # position ids
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[0] == batch:
            return value[slot : slot + 1]
        if isinstance(value, tuple) and value and value[0] == batch:  # a shape
            return (1, *value[1:])
        return value

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not isinstance(output, torch.Tensor) or output.ndim < 2:
            return None
        tokens, size = output.shape[-2:]
        rows = []
        for slot in range(batch):
            slot_args = (for_slot(a, slot, tokens) for a in args)
            row = module.forward(*slot_args, **{k: for_slot(v, slot, tokens) for k, v in kwargs.items()})
            if row.numel() != tokens * size:
                return None  # not a per-token embedding: left as it was (the probe judges the model)
            rows.append(row.reshape(tokens, size))
        return torch.stack(rows)

    handles = [module.register_forward_hook(hook, with_kwargs=True) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
