"""`benchmarks/head_acceptance.py`'s static tree fit (`fit_static_tree`, `--save-trees`) and the
scoring of a fixed tree (`fixed_tree_tau`, `--score-trees`) on synthetic rank tensors: the fitted
tree is prefix-closed, its tau is the best any tree of that size gets, and a fixed tree's tau counts
the leading depths whose rank prefix is a node."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from conftest import load_benchmark

from hf_specdec.config import TreeSpec

bench = load_benchmark("head_acceptance")


def _prefix_closed(paths) -> bool:
    nodes = {tuple(path) for path in paths}
    return len(nodes) == len(paths) and all(node[:-1] in nodes for node in nodes if len(node) > 1)


def _skewed_ranks(chains: int, depth: int, seed: int) -> torch.Tensor:
    """Ranks as a head's look: mostly 0, geometrically rarer beyond; 9 stands for 'not ranked'."""
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.distributions.Geometric(0.55).sample((chains, depth)).long()
    ranks[torch.rand(chains, depth, generator=generator) < 0.05] = 9
    return ranks.clamp(max=9)


def test_fixed_tree_counts_leading_depths_in_the_tree():
    ranks = torch.tensor([[0, 0, 0], [1, 0, 0], [1, 1, 0], [2, 0, 0], [0, 1, 0], [0, 0, 5]])
    tree = [[0], [1], [0, 0]]
    # accepted: [0] [0,0] -> 2; [1] -> 1; [1] (then [1,1] absent) -> 1; rank 2 -> 0; [0] then [0,1] absent -> 1;
    # [0] [0,0] then [0,0,5] absent (and deeper than the tree) -> 2
    assert bench.fixed_tree_tau(ranks, tree) == pytest.approx(1 + 7 / 6)
    assert bench.fixed_tree_tau(ranks, [[0]]) == pytest.approx(1 + 3 / 6)  # the first draft alone
    assert bench.fixed_tree_tau(ranks, [[0], [0, 0], [0, 0, 0]]) == pytest.approx(1 + 6 / 6)  # the k=3 chain
    with pytest.raises(ValueError, match="prefixes"):
        bench.fixed_tree_tau(ranks, [[0], [1, 0]])


def test_fit_ties_go_shallowest_first_and_ranks_stay_below_the_cap():
    ranks = torch.tensor([[0, 0], [1, 1]])
    assert bench.fit_static_tree(ranks, 3)[0] == [[0], [1], [0, 0]]
    ranks = torch.tensor([[0, 0], [0, 0], [1, 9]])
    tree, tau = bench.fit_static_tree(ranks, 2)
    assert tree == [[0], [0, 0]] and tau == pytest.approx(1 + 4 / 3)
    # rank 3 is the most common second draft: a tree of 4 nodes takes it, one of 2 nodes (ranks below 2)
    # or one capped at max_rank=3 (ranks 0..2) cannot; fewer distinct prefixes than N: all of them
    ranks = torch.tensor([[0, 3]] * 5 + [[0, 1]] * 2)
    assert bench.fit_static_tree(ranks, 4) == ([[0], [0, 1], [0, 3]], pytest.approx(1 + 14 / 7))
    assert bench.fit_static_tree(ranks, 2)[0] == [[0], [0, 1]]
    assert bench.fit_static_tree(ranks, 4, max_rank=3)[0] == [[0], [0, 1]]


@pytest.mark.parametrize("seed", [0, 1])
def test_fit_is_prefix_closed_and_the_best_tree_of_its_size(seed):
    ranks = _skewed_ranks(400, 4, seed)
    for nodes in (1, 2, 5, 8, 16, 32):
        tree, tau = bench.fit_static_tree(ranks, nodes)
        assert len(tree) == nodes and _prefix_closed(tree)
        assert tree == sorted(tree, key=lambda path: (len(path), path))  # parents first
        # the fitted tau is the tree's own when scored as a fixed tree, and best_static_tree_tau's
        assert bench.fixed_tree_tau(ranks, tree) == pytest.approx(tau)
        assert bench.best_static_tree_tau(ranks, nodes) == pytest.approx(tau)
        TreeSpec.parse({"static": tree}, max_depth=4)  # a layout generate() takes
    # exhaustively on a small case: no prefix-closed tree of 3 or 4 nodes (ranks below N, depth 2) does better
    small = ranks[:, :2]
    for nodes in (3, 4):
        candidates = [(r,) for r in range(nodes)] + [(a, b) for a in range(nodes) for b in range(nodes)]
        best = max(
            bench.fixed_tree_tau(small, [list(node) for node in subset])
            for subset in itertools.combinations(candidates, nodes)
            if _prefix_closed(subset)
        )
        assert bench.fit_static_tree(small, nodes)[1] == pytest.approx(best)


def test_parse_sets_ranges_and_read_trees(tmp_path):
    assert bench.parse_sets("mt-bench:40,humaneval:20") == [("mt-bench", 40), ("humaneval", 20)]
    assert bench.parse_sets("mt-bench:20:80,humaneval:0:20") == [("mt-bench", 20, 80), ("humaneval", 0, 20)]
    for bad in ("mt-bench:20:20", "mt-bench:30:20", "mt-bench:0", "mt-bench:1:2:3", "mt-bench:a:4", "gsm8k:0:4"):
        with pytest.raises(ValueError, match="--sets"):
            bench.parse_sets(bad)
    path = tmp_path / "trees.json"
    path.write_text(json.dumps({"fitted": {"sets": ["mt-bench:20:80"]}, "2": [[0], [0, 0]], "3": [[0], [1], [0, 0]]}))
    assert bench.read_trees(path) == {2: [[0], [0, 0]], 3: [[0], [1], [0, 0]]}
    path.write_text(json.dumps({"fitted": {}}))
    with pytest.raises(ValueError, match="--score-trees"):
        bench.read_trees(path)
