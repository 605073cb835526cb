"""n-gram draft trees (`NgramProposer(..., tree=TreeSpec)`): hand-made tries and a plain-Python reference."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from hf_specdec.config import SpeculativeConfig, TreeSpec
from hf_specdec.drafters import NgramProposer, ProposeRequest, build_proposer
from hf_specdec.sampling.tree import check_tree


def dynamic(num_nodes: int, topk: int, depth: int) -> TreeSpec:
    return TreeSpec(num_nodes=num_nodes, topk=topk, depth=depth)


def static(paths: list[list[int]], max_depth: int = 8) -> TreeSpec:
    return TreeSpec.parse({"static": paths}, max_depth)


def reference_tree(context: list[int], min_n: int, max_n: int, depth: int, spec: TreeSpec):
    """The brief, written out slowly: every earlier occurrence of the longest matching suffix
    n-gram, continuations (most recent first) merged into a trie, nodes picked by the spec, BFS order."""
    length = len(context)
    if depth <= 0:
        return [], []
    starts: list[int] = []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n :]
        starts = [i + n for i in range(length - n) if context[i : i + n] == suffix]  # ends before the last token
        if starts:
            break
    if not starts:
        return [], []
    nodes: dict[tuple[int, ...], list[int]] = {}  # token path -> [count, recency]
    for recency, start in enumerate(reversed(starts)):
        continuation = context[start : start + depth]
        for end in range(1, len(continuation) + 1):
            nodes.setdefault(tuple(continuation[:end]), [0, recency])[0] += 1
    siblings: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for key in nodes:
        siblings.setdefault(key[:-1], []).append(key)
    rank = {}
    for group in siblings.values():
        group.sort(key=lambda key: (-nodes[key][0], nodes[key][1]))
        for r, key in enumerate(group):
            rank[key] = r

    def rank_path(key):
        return tuple(rank[key[:end]] for end in range(1, len(key) + 1))

    if spec.static_paths is not None:
        listed = set(spec.static_paths)
        chosen = [key for key in nodes if rank_path(key) in listed]
    else:  # best first from the root, the topk best children of each node taken
        chosen = []
        heap = [(-nodes[key][0], nodes[key][1], 1, key) for key in siblings.get((), [])[: spec.topk]]
        heapq.heapify(heap)
        while heap and len(chosen) < spec.num_nodes:
            _, _, _, key = heapq.heappop(heap)
            chosen.append(key)
            for child in siblings.get(key, [])[: spec.topk]:
                heapq.heappush(heap, (-nodes[child][0], nodes[child][1], len(child), child))
    index: dict[tuple[int, ...], int] = {}
    tokens, parents = [], []
    for level in range(1, depth + 1):
        layer = [key for key in chosen if len(key) == level]
        layer.sort(key=lambda key: (index[key[:-1]] if level > 1 else -1, rank[key]))
        for key in layer:
            index[key] = len(tokens)
            tokens.append(key[-1])
            parents.append(index[key[:-1]] if level > 1 else -1)
    return tokens, parents


def propose_rows(proposer: NgramProposer, contexts, max_draft=None):
    request = ProposeRequest(
        rows=list(range(len(contexts))),
        token_ids=[np.asarray(c, dtype=np.int64) for c in contexts],
        max_draft_tokens=[proposer.k] * len(contexts) if max_draft is None else list(max_draft),
    )
    proposal = proposer.propose(request)
    assert proposal.draft_probs is None
    assert proposal.draft_parents is not None and len(proposal.draft_parents) == len(contexts)
    out = []
    for tokens, parents in zip(proposal.draft_token_ids, proposal.draft_parents, strict=True):
        assert tokens.dtype == np.int64 and parents.dtype == np.int64
        check_tree(tokens, parents)
        out.append((tokens.tolist(), parents.tolist()))
    return out


def propose_one(proposer: NgramProposer, context, max_draft=None):
    return propose_rows(proposer, [context], None if max_draft is None else [max_draft])[0]


def test_two_continuations_ranked_by_count():
    # [1, 2] was followed by 3 twice and by 4 once (the most recent): count wins over recency
    context = [1, 2, 3, 1, 2, 3, 1, 2, 4, 9, 1, 2]
    proposer = NgramProposer(1, 2, 2, tree=dynamic(4, 4, 1))
    assert propose_one(proposer, context) == ([3, 4], [-1, -1])


def test_equal_counts_put_the_more_recent_first():
    context = [1, 2, 3, 8, 1, 2, 4, 8, 1, 2]
    proposer = NgramProposer(2, 2, 2, tree=dynamic(8, 4, 2))
    # the trie: 4 -> 8 (recent), 3 -> 8; BFS: both roots' children first, then their children
    assert propose_one(proposer, context) == ([4, 3, 8, 8], [-1, -1, 0, 1])


def test_shared_prefix_merges_and_branches_deeper():
    # after [5]: 6 7 / 6 8 / 6 7 -> one child 6 (3), then 7 (2) before 8 (1)
    context = [5, 6, 7, 0, 5, 6, 8, 0, 5, 6, 7, 0, 5]
    proposer = NgramProposer(3, 1, 1, tree=dynamic(16, 4, 3))
    tokens, parents = propose_one(proposer, context)
    assert tokens == [6, 7, 8, 0, 0] and parents == [-1, 0, 0, 1, 2]


def test_longest_n_decides_the_occurrences():
    # the 2-gram [3, 4] occurred once (then 5); the 1-gram [4] also occurred before 9
    context = [4, 9, 3, 4, 5, 1, 3, 4]
    assert propose_one(NgramProposer(1, 1, 2, tree=dynamic(4, 4, 1)), context) == ([5], [-1])
    assert propose_one(NgramProposer(1, 1, 1, tree=dynamic(4, 4, 1)), context) == ([5, 9], [-1, -1])


def test_topk_limits_children_per_node():
    context = [1, 10, 0, 1, 11, 0, 1, 10, 0, 1, 12, 0, 1]
    # after [1]: 10 (2), then 12 (recent), 11 with one each
    assert propose_one(NgramProposer(1, 1, 1, tree=dynamic(8, 8, 1)), context) == ([10, 12, 11], [-1, -1, -1])
    assert propose_one(NgramProposer(1, 1, 1, tree=dynamic(8, 2, 1)), context) == ([10, 12], [-1, -1])
    assert propose_one(NgramProposer(1, 1, 1, tree=dynamic(8, 1, 1)), context) == ([10], [-1])


def test_num_nodes_keeps_the_best_scoring():
    # after [1]: 10 20 (x2), 11 21 (x1, the most recent)
    context = [1, 10, 20, 0, 1, 10, 20, 0, 1, 11, 21, 0, 1]
    spec = dynamic(8, 4, 2)
    assert propose_one(NgramProposer(2, 1, 1, tree=spec), context) == ([10, 11, 20, 21], [-1, -1, 0, 1])
    # 3 nodes: 10 and 20 (count 2) then 11 (count 1); 21 left out
    assert propose_one(NgramProposer(2, 1, 1, tree=dynamic(3, 4, 2)), context) == ([10, 11, 20], [-1, -1, 0])
    assert propose_one(NgramProposer(2, 1, 1, tree=dynamic(2, 4, 2)), context) == ([10, 20], [-1, 0])
    assert propose_one(NgramProposer(2, 1, 1, tree=dynamic(1, 4, 2)), context) == ([10], [-1])


def test_depth_limits_from_spec_request_and_context_end():
    context = [1, 2, 3, 4, 5, 1]
    assert propose_one(NgramProposer(4, 1, 1, tree=dynamic(8, 2, 4)), context) == ([2, 3, 4, 5], [-1, 0, 1, 2])
    assert propose_one(NgramProposer(4, 1, 1, tree=dynamic(8, 2, 2)), context) == ([2, 3], [-1, 0])
    # max_draft_tokens cuts the depth below tree.depth
    assert propose_one(NgramProposer(4, 1, 1, tree=dynamic(8, 2, 4)), context, max_draft=3) == ([2, 3, 4], [-1, 0, 1])
    # continuations stop at the end of the context: [7, 7, 7] -> after [7] at 1: one 7; at 0: 7, 7
    assert propose_one(NgramProposer(4, 1, 1, tree=dynamic(8, 2, 4)), [7, 7, 7]) == ([7, 7], [-1, 0])


def test_static_paths_pick_ranks():
    # after [1]: 10 (x3: then 20 x2, 21 x1), 11 (x1 most recent... after 10s), 12 (x1)
    context = [1, 10, 20, 0, 1, 12, 22, 0, 1, 10, 21, 0, 1, 10, 20, 0, 1, 11, 23, 0, 1]
    # ranks at the root: 10 (3), 11 (1, recent), 12 (1); under 10: 20 (2), 21 (1)
    full = propose_one(NgramProposer(2, 1, 1, tree=dynamic(16, 4, 2)), context)
    assert full == ([10, 11, 12, 20, 21, 23, 22], [-1, -1, -1, 0, 0, 1, 2])
    assert propose_one(NgramProposer(2, 1, 1, tree=static([[0], [1], [0, 0]])), context) == ([10, 11, 20], [-1, -1, 0])
    assert propose_one(NgramProposer(2, 1, 1, tree=static([[2], [0], [0, 1]])), context) == ([10, 12, 21], [-1, -1, 0])
    # only the second-best child, and its best child
    assert propose_one(NgramProposer(2, 1, 1, tree=static([[1], [1, 0]])), context) == ([11, 23], [-1, 0])
    # listed but absent (no rank 5, no second child under 11) -> left out; a shallower request cuts depth 2
    spec = static([[0], [5], [1], [1, 1], [0, 0]])
    assert propose_one(NgramProposer(2, 1, 1, tree=spec), context) == ([10, 11, 20], [-1, -1, 0])
    assert propose_one(NgramProposer(2, 1, 1, tree=spec), context, max_draft=1) == ([10, 11], [-1, -1])


@pytest.mark.parametrize("spec", (dynamic(8, 2, 4), static([[0], [1], [0, 0]])))
def test_no_match_and_max_draft_zero_are_empty(spec):
    proposer = NgramProposer(4, 1, 3, tree=spec)
    assert propose_one(proposer, list(range(20))) == ([], [])
    assert propose_one(proposer, [5]) == ([], [])
    assert propose_one(NgramProposer(4, 2, 3, tree=spec), [1, 2, 3, 1, 4]) == ([], [])  # only a 1-gram matches
    context = [1, 2, 3, 1, 2]
    assert propose_one(proposer, context, max_draft=0) == ([], [])
    assert propose_one(proposer, context, max_draft=-2) == ([], [])
    assert propose_one(proposer, context)[0] != []


def test_batch_rows_are_independent():
    proposer = NgramProposer(3, 1, 2, tree=dynamic(6, 2, 3))
    contexts = [[1, 2, 3, 4, 1, 2], list(range(30)), [9, 9, 9, 9], [4, 5, 6, 4, 5], [1, 10, 0, 1, 11, 0, 1]]
    max_draft = [3, 3, 2, 0, 1]
    got = propose_rows(proposer, contexts, max_draft)
    expected = [reference_tree(c, 1, 2, min(m, 3), proposer.tree) for c, m in zip(contexts, max_draft)]
    assert got == [tuple(e) for e in expected]
    assert got[1] == ([], []) and got[3] == ([], [])
    assert got[4] == ([11], [-1])  # the 2-gram [0, 1] occurred once


def test_chain_path_unchanged_without_tree():
    proposer = NgramProposer(4, 2, 3)
    proposal = proposer.propose(ProposeRequest(rows=[0], token_ids=[np.array([1, 2, 3, 4, 2, 3])], max_draft_tokens=[4]))
    assert proposal.draft_parents is None
    assert proposal.draft_token_ids[0].tolist() == [4, 2, 3]


def test_build_proposer_passes_the_tree():
    config = SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, tree={"num_nodes": 6, "topk": 2}
    )
    proposer = build_proposer(config, target_model=None)
    assert isinstance(proposer, NgramProposer)
    assert proposer.tree == TreeSpec(num_nodes=6, topk=2, depth=4)
    tokens, parents = propose_one(proposer, [1, 2, 3, 4, 1, 2])
    assert (tokens, parents) == ([3, 4, 1, 2], [-1, 0, 1, 2])
    assert build_proposer(SpeculativeConfig(num_speculative_tokens=4), target_model=None).tree is None


@pytest.mark.parametrize("vocab", (2, 3, 6))
def test_matches_reference_on_random_contexts(vocab):
    rng = np.random.default_rng(vocab)
    specs = [
        dynamic(1, 1, 3),
        dynamic(5, 2, 4),
        dynamic(12, 3, 6),
        dynamic(40, 16, 8),
        static([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
        static([[2], [1], [2, 0], [2, 0, 1], [0], [0, 3]]),
    ]
    proposers = {}
    for case in range(120):
        spec = specs[case % len(specs)]
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        key = (spec, min_n, max_n)
        if key not in proposers:
            proposers[key] = NgramProposer(8, min_n, max_n, tree=spec)
        offset = 0 if case % 2 else 151_000  # large vocab ids sort like small ones
        contexts = [
            (offset + rng.integers(0, vocab, size=int(rng.integers(1, 60)))).tolist()
            for _ in range(int(rng.integers(1, 5)))
        ]
        max_draft = [int(m) for m in rng.integers(0, 10, size=len(contexts))]
        got = propose_rows(proposers[key], contexts, max_draft)
        for context, limit, row in zip(contexts, max_draft, got, strict=True):
            expected = reference_tree(context, min_n, max_n, min(limit, spec.depth, 8), spec)
            assert row == tuple(expected), (case, context, spec, min_n, max_n, limit)
            if spec.static_paths is None:
                assert len(row[0]) <= spec.num_nodes


def test_long_repetitive_context_is_fast_and_bounded():
    # 8k tokens of one repeated 3-token motif: thousands of occurrences, one narrow trie
    context = np.tile(np.array([3, 1, 4], dtype=np.int64), 2700)
    proposer = NgramProposer(8, 1, 4, tree=dynamic(16, 4, 8))
    tokens, parents = propose_one(proposer, context.tolist())
    assert tokens == [3, 1, 4, 3, 1, 4, 3, 1] and parents == [-1, 0, 1, 2, 3, 4, 5, 6]
