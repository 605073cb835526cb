"""What a step needs to verify draft trees: where each node goes in the packed forward, what it
sees, and the prefix its logits processors read.

A row's segment in the verify forward is its pending token(s), then its tree's nodes in node
order (`sampling/tree.py`). The pending tokens sit at the positions after the row's cache, a node
at the last pending token's position plus its depth (positions are what the model's rotary
embedding reads); slots stay in segment order. The tree mask (the last T keys of each row, T the
longest segment) lets a pending token see the pending tokens before it and a node see the pending
tokens, its ancestors and itself; keys before the segment (the row's context) stay visible.
"""

from __future__ import annotations

import numpy as np
import torch

from ..sampling.tree import ancestor_mask, tree_depths


def tree_layout(
    num_cached: np.ndarray, num_pending: np.ndarray, trees: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """(positions of every packed token `[sum of segments]`, tree mask `[rows, T, T]` bool)."""
    segment_lens = num_pending + np.array([len(parents) for parents in trees], dtype=np.int64)
    span = int(segment_lens.max())
    mask = np.zeros((len(trees), span, span), dtype=bool)
    positions = []
    for row, (cached, pending, parents) in enumerate(zip(num_cached, num_pending, trees)):
        length, first = int(pending + len(parents)), span - int(pending + len(parents))
        positions.append(np.concatenate([np.arange(cached, cached + pending), cached + pending - 1 + tree_depths(parents)]))
        row_mask = mask[row]
        row_mask[:, :first] = True  # the row's context, for rows with shorter segments
        row_mask[:pending, first : first + pending] = np.tril(np.ones((pending, pending), dtype=bool))
        row_mask[pending:length, first : first + pending] = True
        row_mask[pending:length, first + pending : first + length] = ancestor_mask(parents)
    return np.concatenate(positions), mask


def tree_prefixes(
    state, rows: np.ndarray, drafts: list[np.ndarray], trees: list[np.ndarray]
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """`process_logits`' (token buffer, buffer rows, prefix lengths) for the verify logits of trees:
    one buffer row per logits row, holding the row's context (as plain generate's `input_ids`: left
    padding included) then the path to the node, so each position's processors see its own prefix."""
    seq_lens = state.seq_lens[rows]
    depths = [tree_depths(parents) for parents in trees]
    width = int(max(length + int(d.max(initial=0)) for length, d in zip(seq_lens, depths)))
    num_logits = sum(len(parents) + 1 for parents in trees)
    buffer = torch.full((num_logits, width), state.pad_token_id, dtype=state.token_buffer.dtype)
    prefix_lens = np.empty(num_logits, dtype=np.int64)
    first = 0
    for row, length, tokens, parents, depth in zip(rows, seq_lens, drafts, trees, depths):
        length = int(length)
        buffer[first : first + len(parents) + 1, :length] = state.token_buffer[row, :length]
        prefix_lens[first] = length
        for node, ancestors in enumerate(ancestor_mask(parents)):
            path = tokens[np.flatnonzero(ancestors)]  # ancestors come before their descendants: root first
            buffer[first + 1 + node, length : length + len(path)] = torch.from_numpy(path)
            prefix_lens[first + 1 + node] = length + depth[node]
        first += len(parents) + 1
    return buffer, np.arange(num_logits), prefix_lens
