"""n-gram (prompt lookup) drafter: KMP search compiled with numba (seed §12.4.4).

For each row, the last n tokens are searched for in the row's earlier context, longest n first
(prompt_lookup_max down to prompt_lookup_min); the tokens that followed the first match are the
draft (up to k: fewer when the match sits near the end of the context).

With a `TreeSpec` each row drafts a tree instead (`sampling/tree.py`): an n-gram that occurred
several times was followed by several continuations, and the verify step can try them all at once.
The longest matching n is found as before, but every earlier occurrence of it counts: their
continuations are merged into a trie whose nodes score by how many continuations pass through them
(the most recent match breaks ties), and the spec picks the nodes (dynamic: the topk best children
of a node, the num_nodes best nodes; static: the listed rank paths).
"""

from __future__ import annotations

import numba
import numpy as np

from ..config import TreeSpec
from .base import DraftProposal, ProposeRequest


@numba.njit(nogil=True, cache=True)
def _kmp_lps(pattern: np.ndarray) -> np.ndarray:
    """Longest proper prefix of pattern[:i+1] that is also its suffix, for every i."""
    lps = np.zeros(pattern.shape[0], dtype=np.int64)
    matched = 0
    i = 1
    while i < pattern.shape[0]:
        if pattern[i] == pattern[matched]:
            matched += 1
            lps[i] = matched
            i += 1
        elif matched != 0:
            matched = lps[matched - 1]
        else:
            i += 1
    return lps


@numba.njit(nogil=True, cache=True)
def _find_after_match(context: np.ndarray, n: int) -> int:
    """Index just after the first earlier occurrence of context's last n tokens, or -1."""
    pattern = context[-n:]
    lps = _kmp_lps(pattern)
    i = 0
    j = 0
    # stop before the suffix itself: a match must end before the last token
    while i < context.shape[0] - 1:
        if context[i] == pattern[j]:
            i += 1
            j += 1
            if j == n:
                return i
        elif j != 0:
            j = lps[j - 1]
        else:
            i += 1
    return -1


@numba.njit(nogil=True, cache=True)
def propose_ngram_batch(
    flat_tokens: np.ndarray,
    row_starts: np.ndarray,
    max_draft_tokens: np.ndarray,
    min_n: int,
    max_n: int,
    out_tokens: np.ndarray,
) -> np.ndarray:
    """Drafts for every row of a batch in one call; returns the number of drafts per row."""
    num_rows = row_starts.shape[0] - 1
    counts = np.zeros(num_rows, dtype=np.int64)
    for row in range(num_rows):
        context = flat_tokens[row_starts[row] : row_starts[row + 1]]
        k = max_draft_tokens[row]
        if k <= 0:
            continue
        for n in range(min(max_n, context.shape[0] - 1), min_n - 1, -1):
            start = _find_after_match(context, n)
            if start >= 0:
                count = min(k, context.shape[0] - start)
                out_tokens[row, :count] = context[start : start + count]
                counts[row] = count
                break
    return counts


# --- trees: every earlier occurrence of the matched n-gram, its continuations merged into a trie ---


@numba.njit(nogil=True, cache=True)
def _all_match_starts(context: np.ndarray, min_n: int, max_n: int) -> np.ndarray:
    """Where the continuation of every earlier occurrence of the longest matching suffix n-gram
    starts, most recent first (empty if no n in min_n..max_n matches).

    One pass over the context finds every n at once: at each position the window that ends there is
    compared with the suffix backwards, so the common length is the longest n that matches there.
    A match must end before the last token (as in the chain path), so each continuation has >= 1 token.
    """
    length = context.shape[0]
    common = np.zeros(length, dtype=np.int64)
    best = 0
    for start in range(length - 1, 0, -1):  # the window ends at start - 1 <= length - 2
        limit = min(max_n, start)
        matched = 0
        while matched < limit and context[start - 1 - matched] == context[length - 1 - matched]:
            matched += 1
        common[start] = matched
        if matched > best:
            best = matched
    if best < min_n or best == 0:
        return np.empty(0, dtype=np.int64)
    count = 0
    for start in range(length - 1, 0, -1):
        if common[start] >= best:
            count += 1
    starts = np.empty(count, dtype=np.int64)
    count = 0
    for start in range(length - 1, 0, -1):
        if common[start] >= best:
            starts[count] = start
            count += 1
    return starts


@numba.njit(nogil=True, cache=True)
def _tree_from_continuations(
    context: np.ndarray,
    starts: np.ndarray,
    depth: int,
    topk: int,
    num_nodes: int,
    static_child: np.ndarray,
    out_tokens: np.ndarray,
    out_parents: np.ndarray,
) -> int:
    """Merge the continuations at `starts` (most recent first, up to `depth` tokens each) into a
    trie, keep the nodes the spec allows and write them BFS-ordered; returns the node count.

    The trie is built depth after depth. The live continuations stay grouped by the node they have
    reached, most recent first within a group; each group is split by its next token with a stable
    sort, skipped when the group agrees (a row repeating itself has thousands of matches that all
    agree), so a row costs at most O(depth * matches * log matches) whatever the vocabulary.
    Score = continuations through a node, ties to the most recent one (`recency` = the smallest index
    into `starts`: siblings never share one, so ranks are a total order). Nodes that can never be
    kept are dropped as soon as their depth is built, and their continuations with them: dynamic, a
    sibling rank >= topk or not among the level's num_nodes best (a kept node is among the num_nodes
    best overall, and a child never ranks above its parent); static (`static_child` has rows), a node
    whose rank path is not listed. `static_child[p + 1, r]`: the static path index of the rank-r child
    of path p (row 0: the root's children).
    """
    num_matches = starts.shape[0]
    length = context.shape[0]
    static = static_child.shape[0] > 0
    width = static_child.shape[1]
    capacity = static_child.shape[0] - 1 if static else num_nodes * depth
    node_token = np.empty(capacity, dtype=np.int64)
    node_parent = np.empty(capacity, dtype=np.int64)
    node_score = np.empty(capacity, dtype=np.int64)
    node_recency = np.empty(capacity, dtype=np.int64)
    node_rank = np.empty(capacity, dtype=np.int64)
    node_static = np.empty(capacity, dtype=np.int64)
    level_start = np.zeros(depth + 1, dtype=np.int64)
    total = 0
    spread = num_matches + 1  # key of a node: (num_matches - score) * spread + recency, best first
    # live continuations: index into `starts`, grouped by the node reached (-1: the root)
    live = np.arange(num_matches)
    live_node = np.full(num_matches, -1, dtype=np.int64)
    num_live = num_matches
    tokens = np.empty(num_matches, dtype=np.int64)
    scratch = np.empty(num_matches, dtype=np.int64)
    # candidate children of this depth: parent, token, score, recency; its continuations are
    # live[cand_first : cand_first + score]
    cand_parent = np.empty(num_matches, dtype=np.int64)
    cand_token = np.empty(num_matches, dtype=np.int64)
    cand_score = np.empty(num_matches, dtype=np.int64)
    cand_recency = np.empty(num_matches, dtype=np.int64)
    cand_first = np.empty(num_matches, dtype=np.int64)
    cand_rank = np.empty(num_matches, dtype=np.int64)
    cand_key = np.empty(num_matches, dtype=np.int64)
    cand_static = np.empty(num_matches, dtype=np.int64)
    keep = np.empty(num_matches, dtype=np.bool_)
    levels = 0
    for level in range(depth):
        # continuations long enough to reach this depth (order kept)
        kept_live = 0
        for i in range(num_live):
            if starts[live[i]] + level < length:
                live[kept_live] = live[i]
                live_node[kept_live] = live_node[i]
                tokens[kept_live] = context[starts[live[i]] + level]
                kept_live += 1
        num_live = kept_live
        if num_live == 0:
            break
        num_cand = 0
        first = 0
        while first < num_live:
            last = first + 1
            agree = True
            while last < num_live and live_node[last] == live_node[first]:
                agree = agree and tokens[last] == tokens[first]
                last += 1
            if not agree:  # split by token, stable: each run stays most recent first
                order = np.argsort(tokens[first:last], kind="mergesort")
                for i in range(last - first):
                    scratch[i] = live[first + order[i]]
                live[first:last] = scratch[: last - first]
                for i in range(last - first):
                    scratch[i] = tokens[first + order[i]]
                tokens[first:last] = scratch[: last - first]
            siblings = num_cand
            for i in range(first, last):
                if i == first or tokens[i] != tokens[i - 1]:
                    cand_parent[num_cand] = live_node[first]
                    cand_token[num_cand] = tokens[i]
                    cand_score[num_cand] = 0
                    cand_recency[num_cand] = live[i]
                    cand_first[num_cand] = i
                    num_cand += 1
                cand_score[num_cand - 1] += 1
            for c in range(siblings, num_cand):
                cand_key[c] = (num_matches - cand_score[c]) * spread + cand_recency[c]
            if num_cand - siblings == 1:
                cand_rank[siblings] = 0
            else:
                sibling_order = np.argsort(cand_key[siblings:num_cand], kind="mergesort")
                for rank in range(num_cand - siblings):
                    cand_rank[siblings + sibling_order[rank]] = rank
            first = last
        # which candidates become nodes
        if static:
            for c in range(num_cand):
                row = 0 if cand_parent[c] < 0 else node_static[cand_parent[c]] + 1
                cand_static[c] = static_child[row, cand_rank[c]] if cand_rank[c] < width else -1
                keep[c] = cand_static[c] >= 0
        else:
            num_kept = 0
            for c in range(num_cand):
                keep[c] = cand_rank[c] < topk
                cand_static[c] = -1
                if keep[c]:
                    num_kept += 1
            if num_kept > num_nodes:
                best_first = np.argsort(cand_key[:num_cand], kind="mergesort")
                seen = 0
                for position in range(num_cand):
                    c = best_first[position]
                    if keep[c]:
                        seen += 1
                        if seen > num_nodes:
                            keep[c] = False
        # kept candidates become nodes; their runs of continuations go on, grouped by the new node
        kept_live = 0
        for c in range(num_cand):
            if not keep[c]:
                continue
            node_token[total] = cand_token[c]
            node_parent[total] = cand_parent[c]
            node_score[total] = cand_score[c]
            node_recency[total] = cand_recency[c]
            node_rank[total] = cand_rank[c]
            node_static[total] = cand_static[c]
            run_first = cand_first[c]
            for i in range(run_first, run_first + cand_score[c]):
                live[kept_live] = live[i]
                live_node[kept_live] = total
                kept_live += 1
            total += 1
        num_live = kept_live
        levels = level + 1
        level_start[levels] = total
    # dynamic: the num_nodes best overall (ties: a parent before its child, by depth)
    chosen = np.ones(total, dtype=np.bool_)
    if not static and total > num_nodes:
        overall = np.empty(total, dtype=np.int64)
        for level in range(levels):
            for node in range(level_start[level], level_start[level + 1]):
                key = (num_matches - node_score[node]) * spread + node_recency[node]
                overall[node] = key * (depth + 1) + level
        best_first = np.argsort(overall, kind="mergesort")
        for position in range(num_nodes, total):
            chosen[best_first[position]] = False
    # emit depth by depth, each depth by (parent's output index, rank)
    out_index = np.full(total, -1, dtype=np.int64)
    count = 0
    for level in range(levels):
        first, last = level_start[level], level_start[level + 1]
        emit_key = np.empty(last - first, dtype=np.int64)
        for node in range(first, last):
            parent = node_parent[node]
            parent_index = -1 if parent < 0 else out_index[parent]
            emit_key[node - first] = (parent_index + 1) * spread + node_rank[node]
        emit_order = np.argsort(emit_key, kind="mergesort")
        for position in range(last - first):
            node = first + emit_order[position]
            if not chosen[node]:
                continue
            parent = node_parent[node]
            out_tokens[count] = node_token[node]
            out_parents[count] = -1 if parent < 0 else out_index[parent]
            out_index[node] = count
            count += 1
    return count


@numba.njit(nogil=True, cache=True)
def propose_ngram_tree_batch(
    flat_tokens: np.ndarray,
    row_starts: np.ndarray,
    max_depth: np.ndarray,
    min_n: int,
    max_n: int,
    topk: int,
    num_nodes: int,
    static_child: np.ndarray,
    out_tokens: np.ndarray,
    out_parents: np.ndarray,
) -> np.ndarray:
    """Draft trees for every row of a batch in one call (see `_tree_from_continuations`); returns
    the number of nodes per row, written to out_tokens / out_parents[row, :count]."""
    num_rows = row_starts.shape[0] - 1
    counts = np.zeros(num_rows, dtype=np.int64)
    for row in range(num_rows):
        depth = max_depth[row]
        context = flat_tokens[row_starts[row] : row_starts[row + 1]]
        if depth <= 0 or context.shape[0] < 2:
            continue
        starts = _all_match_starts(context, min_n, max_n)
        if starts.shape[0] == 0:
            continue
        counts[row] = _tree_from_continuations(
            context, starts, depth, topk, num_nodes, static_child, out_tokens[row], out_parents[row]
        )
    return counts


def static_child_table(static_paths: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """`[len(paths) + 1, max rank + 1]`: row p + 1 (row 0: the root) maps a child rank to the index of
    that child's path in `static_paths`, -1 where not listed; the numba builder walks it depth by depth."""
    index = {path: i for i, path in enumerate(static_paths)}
    width = max(path[-1] for path in static_paths) + 1
    table = np.full((len(static_paths) + 1, width), -1, dtype=np.int64)
    for path, i in index.items():
        parent = index[path[:-1]] if len(path) > 1 else -1
        table[parent + 1, path[-1]] = i
    return table


class NgramProposer:
    """Prompt-lookup drafts from each row's own prompt and generated tokens: a chain per row, or a
    tree per row when `tree` is given (at most min(max_draft_tokens, tree.depth, k) deep). A row of an
    encoder-decoder model also looks in its source (`set_source`): there the prompt is the source, and a
    summary or a translation copies names and phrases from it."""

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        tree: TreeSpec | None = None,
    ):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.tree = tree
        if tree is not None:
            # an empty table says "dynamic" to the numba builder
            self._static_child = (
                static_child_table(tree.static_paths)
                if tree.static_paths is not None
                else np.empty((0, 1), dtype=np.int64)
            )
            self._max_nodes = len(tree.static_paths) if tree.static_paths is not None else tree.num_nodes
        self.sources: dict[int, np.ndarray] = {}  # per row: the source tokens searched before its own
        # compile now, not on the user's first step
        self.propose(ProposeRequest(rows=[0], token_ids=[np.zeros(64, dtype=np.int64)], max_draft_tokens=[self.k]))

    def set_source(self, row: int, token_ids: np.ndarray) -> None:
        """Row `row`'s source tokens (an encoder-decoder model's, in its decoder's vocabulary): its n-grams are
        looked up there before its own tokens, until `release`."""
        self.sources[row] = np.asarray(token_ids, dtype=np.int64)

    def _contexts(self, request: ProposeRequest) -> tuple[np.ndarray, np.ndarray]:
        """Every row's searched tokens (its source, if any, then its own), flat, and where each row starts."""
        contexts = [
            np.concatenate([self.sources[row], tokens]) if row in self.sources else tokens
            for row, tokens in zip(request.rows, request.token_ids)
        ]
        lengths = np.array([len(tokens) for tokens in contexts], dtype=np.int64)
        return np.concatenate(contexts).astype(np.int64, copy=False), np.concatenate([[0], np.cumsum(lengths)])

    def propose(self, request: ProposeRequest) -> DraftProposal:
        if self.tree is not None:
            return self._propose_tree(request)
        flat_tokens, row_starts = self._contexts(request)
        max_draft = np.minimum(np.asarray(request.max_draft_tokens, dtype=np.int64), self.k)
        out_tokens = np.zeros((len(request.rows), self.k), dtype=np.int64)
        counts = propose_ngram_batch(flat_tokens, row_starts, max_draft, self.min_n, self.max_n, out_tokens)
        return DraftProposal(draft_token_ids=[out_tokens[i, : counts[i]] for i in range(len(request.rows))])

    def _propose_tree(self, request: ProposeRequest) -> DraftProposal:
        """One numba call for the batch; rows without a match (or max_draft 0) get empty arrays."""
        tree = self.tree.for_step(request.max_tree_nodes)
        flat_tokens, row_starts = self._contexts(request)
        max_depth = np.minimum(np.asarray(request.max_draft_tokens, dtype=np.int64), min(tree.depth, self.k))
        out_tokens = np.zeros((len(request.rows), self._max_nodes), dtype=np.int64)
        out_parents = np.zeros((len(request.rows), self._max_nodes), dtype=np.int64)
        counts = propose_ngram_tree_batch(
            flat_tokens,
            row_starts,
            max_depth,
            self.min_n,
            self.max_n,
            tree.topk,
            tree.num_nodes,
            self._static_child,
            out_tokens,
            out_parents,
        )
        rows = range(len(request.rows))
        return DraftProposal(
            draft_token_ids=[out_tokens[i, : counts[i]] for i in rows],
            draft_parents=[out_parents[i, : counts[i]] for i in rows],
        )

    def release(self, rows: list[int], token_ids: list[np.ndarray] | None = None) -> None:
        for row in rows:
            self.sources.pop(row, None)
