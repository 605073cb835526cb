"""Model forwards over the paged cache: every row's new tokens packed into one forward, or one
forward per row when the cache holds a hybrid model's recurrent state (`recurrent.py`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import numpy as np
import torch
from transformers import PreTrainedModel

from ..profiling import timed_forward
from ..tensor_parallel import check_ranks_agree, tensor_parallel_group
from ..token_rows import tokens_at
from ..transfer import to_device
from .paged_cache import PagedKVCache


@functools.cache
def takes_logits_to_keep(model_class: type) -> bool:
    """Whether the model's forward computes logits only where asked (`logits_to_keep`). A few do not
    (MiniCPM-V 4.6, VideoLLaMA 3, TrOCR): they compute every position's, in plain generate() too."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def run_rows(
    cache: PagedKVCache,
    rows: list[int],
    counts: list[int],
    keep: np.ndarray,
    forward: Callable[[slice, np.ndarray], torch.Tensor],
    tree_mask: np.ndarray | None = None,
) -> torch.Tensor:
    """One forward over every row's new tokens, packed, or one per row when the cache holds recurrent
    state (`one_row_per_forward`); the outputs at `keep` in order.

    `counts[i]` new tokens of `rows[i]`, packed row after row; `keep`: sorted indices into those
    packed tokens. `forward(tokens, keep)` runs the model on the packed tokens `tokens` (a slice,
    after this function's `prepare_forward` for them) and returns its outputs at `keep`, indices
    into that slice. `tree_mask`: the rows' draft trees (`PagedAttentionMetadata.tree_mask`).
    """
    if not cache.one_row_per_forward:
        cache.prepare_forward(rows, counts, tree_mask=tree_mask)
        return forward(slice(0, int(sum(counts))), keep)
    if tree_mask is not None and cache.recurrent is not None:
        raise ValueError("draft trees are not supported on models with recurrent layers (their state follows one path)")
    outputs, start = [], 0
    for index, (row, count) in enumerate(zip(rows, counts)):
        # a row's tree mask covers its own last keys: its slice holds for the row alone
        row_tree = None if tree_mask is None else tree_mask[index : index + 1, : int(count)]
        cache.prepare_forward([row], [int(count)], tree_mask=row_tree)
        mine = keep[(keep >= start) & (keep < start + count)] - start
        outputs.append(forward(slice(start, start + int(count)), mine))  # run even when nothing is kept: it feeds the state
        start += int(count)
    return torch.cat(outputs)


def forward_tokens(
    model: PreTrainedModel,
    cache: PagedKVCache,
    rows: list[int],
    counts: list[int],
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    keep: np.ndarray,
    tree_mask: np.ndarray | None = None,
) -> torch.Tensor:
    """The model's logits `[len(keep), vocab]` at packed positions `keep` after feeding `counts[i]`
    new tokens of each row (`input_ids` / `position_ids`: `[sum(counts)]`, on the model's device).

    A tensor-parallel model's ranks first check they feed the same tokens (`tensor_parallel.py`)."""
    group = tensor_parallel_group(model)
    if group is not None:
        check_ranks_agree(group, input_ids, position_ids)

    selects = takes_logits_to_keep(type(model))

    def forward(tokens: slice, kept: np.ndarray) -> torch.Tensor:
        if cache.batch_layout is not None:  # a batch on the model's own cache (own_attention.py)
            return _batched_forward(model, cache, input_ids[tokens], position_ids[tokens], kept, selects)
        logits_to_keep = to_device([kept], input_ids.device)[0]
        inputs = cache.model_inputs(input_ids[None, tokens], position_ids[None, tokens])
        with timed_forward(input_ids.device):
            if selects:
                return model(**inputs, use_cache=True, logits_to_keep=logits_to_keep).logits[0]
            return model(**inputs, use_cache=True).logits[0, logits_to_keep]

    return run_rows(cache, rows, counts, keep, forward, tree_mask=tree_mask)


def _batched_forward(
    model: PreTrainedModel, cache: PagedKVCache, input_ids: torch.Tensor, position_ids: torch.Tensor, kept: np.ndarray,
    selects: bool,
) -> torch.Tensor:  # fmt: skip
    """The forward of packed tokens laid out `[rows, width]` (`cache.batch_layout`): the logits at `kept`."""
    layout = cache.batch_layout
    needed, picked = np.unique(layout.columns[kept], return_inverse=True)
    logits_to_keep, rows, picked = to_device([needed, layout.slots[kept], picked], input_ids.device)
    inputs = cache.model_inputs(layout.scatter(input_ids), layout.scatter(position_ids))
    with timed_forward(input_ids.device), tokens_at((layout.batch_size, layout.width), layout.positions), cache.forward_context():
        if selects:
            logits = model(**inputs, use_cache=True, logits_to_keep=logits_to_keep).logits
        else:
            logits = model(**inputs, use_cache=True).logits[:, logits_to_keep]
    return logits[rows, picked]
