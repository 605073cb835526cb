"""Draft trees: how a row's tree of draft tokens is described between drafter, loop and sampler.

A row's drafts form a tree rooted at the row's last context token (the root is not a draft). Node
i (0-based) holds draft token `tokens[i]` and its parent `parents[i]`: -1 for a child of the root,
else the index of an earlier node (`parents[i] < i`: parents come first). A chain of k drafts is
the tree with parents [-1, 0, 1, ..., k-2]. Siblings hold distinct tokens and come in the order the
drafter ranks them (best first): the sampled acceptance tries them in that order.

The verify forward puts node i at the slot after the row's pending tokens plus i, at the position
of the root plus its depth; `ancestor_mask` says which of the row's new tokens each one sees.
"""

from __future__ import annotations

import numpy as np


def chain_parents(num_drafts: int) -> np.ndarray:
    """The parents of a chain of `num_drafts` drafts: [-1, 0, 1, ...]."""
    return np.arange(num_drafts, dtype=np.int64) - 1


def check_tree(tokens: np.ndarray, parents: np.ndarray) -> None:
    """ValueError unless (tokens, parents) is a draft tree as the module docstring describes."""
    tokens, parents = np.asarray(tokens), np.asarray(parents)
    if tokens.shape != parents.shape or tokens.ndim != 1:
        raise ValueError(f"draft tree: tokens {tokens.shape} and parents {parents.shape} must be equal 1-d shapes")
    index = np.arange(len(parents))
    if np.any(parents < -1) or np.any(parents >= index):
        raise ValueError(f"draft tree: every parent must be -1 or an earlier node, got parents {parents.tolist()}")
    pairs = set()
    for token, parent in zip(tokens.tolist(), parents.tolist()):
        if (parent, token) in pairs:
            raise ValueError(f"draft tree: token {token} appears twice among the children of node {parent}")
        pairs.add((parent, token))


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Depth of every node: 1 for the root's children."""
    depths = np.ones(len(parents), dtype=np.int64)
    for node, parent in enumerate(parents):
        if parent >= 0:
            depths[node] = depths[parent] + 1
    return depths


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """`[n, n]` bool: node a sees node b iff b is a or one of its ancestors."""
    num_nodes = len(parents)
    mask = np.eye(num_nodes, dtype=bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
    return mask


def children_of(parents: np.ndarray) -> list[list[int]]:
    """`children[0]`: the root's children; `children[i + 1]`: node i's; each in node order (the drafter's rank)."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[int(parent) + 1].append(node)
    return children


def path_to(parents: np.ndarray, node: int) -> list[int]:
    """The nodes from the root's child down to `node` (inclusive); [] for node -1 (the root)."""
    path = []
    while node >= 0:
        path.append(int(node))
        node = int(parents[node])
    return path[::-1]
