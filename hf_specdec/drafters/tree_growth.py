"""EAGLE-2 draft-tree growth, shared by the drafters that grow a tree with a model of their own
(EAGLE / EAGLE-3 heads, draft models). The drafter runs its model; this module keeps the books.

A node scores the sum of its path's draft log-probabilities (Li et al. 2024). The drafter's
output at a row's last context token gives the root's `topk` best children (`expand`). Each depth
then feeds the frontier (`frontier`: the `topk` best nodes of the depth before; static trees: the
nodes the layout continues), every row's in one forward over the drafter's own paged cache with
the tree mask `feed` builds (a node sees the context, its fed ancestors and itself), and the
outputs for the fed nodes give their `topk` best children. At the end `trees` keeps the
`num_nodes` best nodes overall (static: the listed rank paths); a parent never scores below its
child and wins ties, so the kept nodes form a tree, emitted parents first with siblings in rank
order (`sampling/tree.py`). Row j goes at most `min(wanted[j], depth)` deep.

Candidates a row's drafter rules out (log-probability -inf, e.g. under a top-k / top-p warper)
are not added: a node the drafter gives no chance only takes a slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from ..config import TreeSpec


class Candidate(NamedTuple):
    token: int
    parent: int  # index of the parent candidate in the row's list, -1 for a child of the root
    depth: int  # 1 for the root's children
    score: float  # sum of the path's draft log-probabilities
    path: tuple[int, ...]  # child ranks from the root


def ranked_children(
    logits: torch.Tensor, topk: int, to_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's `topk` best next tokens by log-softmax of `logits` `[n, vocab]`, best first:
    (tokens `[n, topk]`, their log-probabilities `[n, topk]`) on the host. `to_tokens` maps the
    model's ids to target ids (an EAGLE head's reduced vocabulary)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    scores, ids = log_probs.topk(min(topk, log_probs.shape[-1]), dim=-1)
    if to_tokens is not None:
        ids = to_tokens(ids)
    return ids.cpu().numpy(), scores.cpu().numpy()


def max_fed_nodes(spec: TreeSpec) -> int:
    """The most tree nodes a row feeds to its drafter in one call (the slots its cache needs past the
    context): dynamic, `topk` per depth but the last; static, the listed nodes that have children."""
    if spec.static_paths is None:
        return spec.topk * (spec.depth - 1)
    return len({path[:-1] for path in spec.static_paths if len(path) > 1})


class TreeGrowth:
    """The candidates of every row of one drafter call; rows are numbered 0..len(wanted)-1."""

    def __init__(self, spec: TreeSpec, wanted: np.ndarray):
        self.spec = spec
        self.static = None if spec.static_paths is None else set(spec.static_paths)
        # the static paths that have children: a node on one of them is fed
        self.continued = None if self.static is None else {p[:d] for p in self.static for d in range(1, len(p))}
        self.depth_limit = np.minimum(np.asarray(wanted, dtype=np.int64), spec.depth)
        self.nodes: list[list[Candidate]] = [[] for _ in self.depth_limit]
        self.fed: list[list[int]] = [[] for _ in self.depth_limit]  # candidates in the drafter's cache, in slot order
        self.drafting = [j for j, limit in enumerate(self.depth_limit) if limit >= 1]

    @property
    def max_depth(self) -> int:
        return int(self.depth_limit.max(initial=0))

    def expand(self, parents: list[tuple[int, int]], tokens: np.ndarray, scores: np.ndarray) -> None:
        """Add the children of each (row, candidate or -1 for the root): `tokens[i]` / `scores[i]`,
        the `ranked_children` of `parents[i]`."""
        static = self.static
        for (j, parent), row_tokens, row_scores in zip(parents, tokens, scores):
            depth, score, path = (0, 0.0, ()) if parent < 0 else self.nodes[j][parent][2:]
            for rank, (token, token_score) in enumerate(zip(row_tokens, row_scores)):
                if token_score == -np.inf:
                    continue
                if static is None or (*path, rank) in static:
                    self.nodes[j].append(Candidate(int(token), parent, depth + 1, score + float(token_score), (*path, rank)))

    def frontier(self, depth: int) -> list[tuple[int, int]]:
        """The (row, candidate) fed at `depth` (whose children form depth + 1), row by row."""
        frontier = []
        for j in self.drafting:
            if self.depth_limit[j] <= depth:
                continue
            nodes = self.nodes[j]
            at_depth = [c for c, node in enumerate(nodes) if node.depth == depth]
            if self.static is None:
                at_depth = sorted(at_depth, key=lambda c: -nodes[c].score)[: self.spec.topk]
            else:  # the nodes the layout continues
                at_depth = [c for c in at_depth if nodes[c].path in self.continued]
            frontier += [(j, c) for c in sorted(at_depth)]
        return frontier

    def feed(self, frontier: list[tuple[int, int]]) -> tuple[list[int], list[int], np.ndarray]:
        """Lay out a forward of `frontier`: (its rows in order, the count of each,
        `PagedAttentionMetadata.tree_mask`), and record its nodes as fed after the rows' earlier ones."""
        frontier_rows = list(dict.fromkeys(j for j, _ in frontier))
        counts = [sum(1 for j, _ in frontier if j == r) for r in frontier_rows]
        mask = self._tree_mask(frontier_rows, counts, frontier)
        for j, c in frontier:
            self.fed[j].append(c)
        return frontier_rows, counts, mask

    def _tree_mask(self, frontier_rows: list[int], counts: list[int], frontier: list[tuple[int, int]]) -> np.ndarray:
        """A new node sees itself and the fed candidates that are its ancestors; the context before
        the tree stays visible."""
        spans = [len(self.fed[j]) + count for j, count in zip(frontier_rows, counts)]
        span = max(spans)
        mask = np.zeros((len(frontier_rows), max(counts), span), dtype=bool)
        index = 0
        for r, (j, count, row_span) in enumerate(zip(frontier_rows, counts, spans)):
            nodes, first = self.nodes[j], span - row_span
            mask[r, :, :first] = True
            slot = {c: first + i for i, c in enumerate(self.fed[j])}
            for a in range(count):
                mask[r, a, first + len(self.fed[j]) + a] = True
                parent = nodes[frontier[index + a][1]].parent
                while parent >= 0:
                    mask[r, a, slot[parent]] = True
                    parent = nodes[parent].parent
            index += count
        return mask

    def trees(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Every row's kept tree: (tokens, parents), parents first, siblings in rank order."""
        tokens_out, parents_out = [], []
        for nodes in self.nodes:
            kept = list(range(len(nodes)))
            if self.static is None:
                kept = sorted(kept, key=lambda c: (-nodes[c].score, nodes[c].depth))[: self.spec.num_nodes]
            kept.sort(key=lambda c: (nodes[c].depth, -nodes[c].score))  # parents first, siblings by rank
            order = {c: i for i, c in enumerate(kept)}
            tokens_out.append(np.array([nodes[c].token for c in kept], dtype=np.int64))
            parents_out.append(np.array([order.get(nodes[c].parent, -1) for c in kept], dtype=np.int64))
        return tokens_out, parents_out
