"""The EAGLE-3 draft vocabulary: the target tokens that occur most often where the head is trained.

A head scoring 32k of a 128k vocabulary spends a quarter of the lm_head time and loses only the
rare tokens (EAGLE-3, SpecForge). Counting only assistant tokens counts what the head will have
to draft. Draft ids are the chosen target ids in ascending order, so `d2t` (draft -> target
offset) is monotonic and easy to read.
"""

from __future__ import annotations

import numpy as np

from .data import TokenizedData


def frequent_tokens(data: TokenizedData, size: int, target_vocab_size: int) -> np.ndarray:
    """The `size` target ids most frequent on loss positions (ties: lower id first), ascending.

    When fewer than `size` distinct ids occur, the rest are filled with the lowest unseen ids so
    the head's lm_head keeps the requested shape.
    """
    if not 1 <= size <= target_vocab_size:
        raise ValueError(
            f"--draft-vocab-size={size} is invalid; allowed: 1 to the target's vocabulary size {target_vocab_size}"
        )
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    for ids, mask in zip(data.input_ids, data.loss_masks):
        ids_arr, mask_arr = np.asarray(ids), np.asarray(mask, dtype=bool)
        np.add.at(counts, ids_arr[mask_arr], 1)
    # stable sort on -count keeps ascending ids among equal counts
    chosen = np.argsort(-counts, kind="stable")[:size]
    return np.sort(chosen)
