"""Tree acceptance (`hf_specdec.sampling.tree_acceptance.accept_tree`): greedy walks on hand-built
trees, token-for-token agreement with the chain rejection sampler on chains, and a chi-square test
that the sampled walk emits the target's distribution at the root and at each node (and that a
deliberately broken sibling rule fails the same test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from hf_specdec.sampling import tree_acceptance
from hf_specdec.sampling.metadata import SpecDecodeMetadata
from hf_specdec.sampling.rejection_reference import RandomDraws, draw_random, rejection_sample_reference
from hf_specdec.sampling.tree import chain_parents, children_of, path_to
from hf_specdec.sampling.tree_acceptance import accept_tree

VOCAB = 10
CPU = torch.device("cpu")


def row_logits(argmaxes: list[int], generator: torch.Generator) -> torch.Tensor:
    """`[len(argmaxes), VOCAB]` noise in [0, 1) with +5 at each row's argmax."""
    logits = torch.rand(len(argmaxes), VOCAB, generator=generator)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] += 5.0
    return logits


# (tokens, parents, argmax at the root then at each node, expected output tokens, expected accepted nodes)
# The shared tree: root -> nodes 0 (5), 1 (3), 2 (7); node 0 -> 3 (2); node 1 -> 4 (8), 5 (4); node 4 -> 6 (6).
TREE_TOKENS = [5, 3, 7, 2, 8, 4, 6]
TREE_PARENTS = [-1, -1, -1, 0, 1, 1, 4]
GREEDY_CASES = {
    # second sibling at the root, then second child of node 1 (a leaf): bonus = argmax at node 5
    "second_sibling_to_leaf": (TREE_TOKENS, TREE_PARENTS, [3, 0, 4, 0, 0, 0, 9, 0], [3, 4, 9], [1, 5]),
    # down to the deepest leaf (node 6): bonus = argmax at node 6
    "deepest_leaf_bonus": (TREE_TOKENS, TREE_PARENTS, [3, 0, 8, 0, 0, 6, 0, 1], [3, 8, 6, 1], [1, 4, 6]),
    # node 1 accepted, but no child of node 1 holds its argmax: the extra token is that argmax
    "stop_inside": (TREE_TOKENS, TREE_PARENTS, [3, 0, 9, 0, 0, 0, 0, 0], [3, 9], [1]),
    # no child of the root matches: the extra token is the argmax at the root
    "reject_at_root": (TREE_TOKENS, TREE_PARENTS, [9, 5, 3, 7, 2, 8, 4, 6], [9], []),
    # the first sibling, then its only child (leaf), bonus
    "first_sibling_chain": (TREE_TOKENS, TREE_PARENTS, [5, 2, 0, 0, 7, 0, 0, 0], [5, 2, 7], [0, 3]),
    "no_drafts": ([], [], [4], [4], []),
    "chain": ([1, 2, 3], [-1, 0, 1], [1, 2, 0, 9], [1, 2, 0], [0, 1]),
}


def run_greedy(cases: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    metadata = SpecDecodeMetadata.from_drafts([np.array(case[0], dtype=np.int64) for case in cases])
    logits = torch.cat([row_logits(case[2], generator) for case in cases])
    parents = [np.array(case[1], dtype=np.int64) for case in cases]
    return accept_tree(metadata, parents, logits, torch.ones(len(cases), dtype=torch.bool))


@pytest.mark.parametrize("name", sorted(GREEDY_CASES))
def test_greedy_hand_built(name):
    case = GREEDY_CASES[name]
    output, num_accepted, accepted_nodes = run_greedy([case])
    depth = max((len(path_to(np.array(case[1]), node)) for node in range(len(case[1]))), default=0)
    expected_output = case[3] + [-1] * (depth + 1 - len(case[3]))
    assert output.tolist() == [expected_output]
    assert num_accepted.tolist() == [len(case[4])]
    assert accepted_nodes.tolist() == [case[4] + [-1] * (depth - len(case[4]))]


def test_greedy_ragged_batch():
    """All cases in one batch (trees of depth 3, 0 and a chain of 3): each row as on its own, padded
    to the deepest tree; zero-node rows emit just the extra token."""
    names = sorted(GREEDY_CASES)
    output, num_accepted, accepted_nodes = run_greedy([GREEDY_CASES[n] for n in names])
    assert output.shape == (len(names), 4) and accepted_nodes.shape == (len(names), 3)
    for row, name in enumerate(names):
        _, _, _, tokens, nodes = GREEDY_CASES[name]
        assert output[row].tolist() == tokens + [-1] * (4 - len(tokens)), name
        assert num_accepted[row].item() == len(nodes), name
        assert accepted_nodes[row].tolist() == nodes + [-1] * (3 - len(nodes)), name


def test_all_rows_without_drafts():
    output, num_accepted, accepted_nodes = run_greedy([GREEDY_CASES["no_drafts"]] * 2)
    assert output.tolist() == [[4], [4]] and num_accepted.tolist() == [0, 0]
    assert accepted_nodes.shape == (2, 0)


def random_chains(rows: int, seed: int, vocab: int = 8) -> tuple[SpecDecodeMetadata, list[np.ndarray], torch.Tensor]:
    """Ragged chains (0-4 drafts), logits with temperature-like spread; drafts drawn from p at the
    position they are verified at (so acceptance, rejection and bonus all happen)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 5, size=rows)
    logits = torch.from_numpy(rng.normal(0, 2.0, size=(int(lengths.sum()) + rows, vocab)).astype(np.float32))
    p = torch.softmax(logits.double(), dim=-1).numpy()
    drafts, first = [], 0
    for length in lengths:
        drafts.append(np.array([rng.choice(vocab, p=p[first + i] / p[first + i].sum()) for i in range(length)]))
        first += length + 1
    return SpecDecodeMetadata.from_drafts(drafts), [chain_parents(n) for n in lengths], logits


def test_chain_equals_rejection_sampler_greedy():
    metadata, parents, logits = random_chains(rows=400, seed=1)
    is_greedy = torch.ones(metadata.num_rows, dtype=torch.bool)
    output, num_accepted, accepted_nodes = accept_tree(metadata, parents, logits, is_greedy)
    expected_output, expected_accepted = rejection_sample_reference(metadata, logits, is_greedy)
    assert torch.equal(output, expected_output) and torch.equal(num_accepted, expected_accepted)
    offsets = torch.arange(metadata.max_spec_len)
    assert torch.equal(accepted_nodes, torch.where(offsets < num_accepted[:, None], offsets, -1))


def test_chain_equals_rejection_sampler_sampled_and_mixed():
    """On a chain, one-hot drafts: the tree rule with one child accepts when u * 1 < p(x) and races
    over p with x zeroed, the chain sampler's test and residual, so on the same draws both emit the
    same tokens, row for row; every 4th row greedy (a mixed batch)."""
    metadata, parents, logits = random_chains(rows=3000, seed=2)
    is_greedy = torch.tensor([row % 4 == 0 for row in range(metadata.num_rows)])
    generators = [None if g else torch.Generator().manual_seed(1000 + r) for r, g in enumerate(is_greedy.tolist())]
    draws = draw_random(generators, metadata, logits.shape[1], CPU)
    output, num_accepted, accepted_nodes = accept_tree(metadata, parents, logits, is_greedy, draws=draws)
    expected_output, expected_accepted = rejection_sample_reference(metadata, logits, is_greedy, draws=draws)
    assert torch.equal(output, expected_output) and torch.equal(num_accepted, expected_accepted)
    sampled = ~is_greedy & (torch.tensor(metadata.num_draft_tokens) > 0)
    accepted = num_accepted[sampled].float().mean().item()
    assert 0.2 < accepted < 2.5, "acceptance, rejection and bonus should all occur"
    assert (num_accepted[sampled] == torch.tensor(metadata.num_draft_tokens)[sampled]).any()


# the distribution test's tree: root -> 0, 1, 2; node 0 -> 3, 4; node 1 -> 5, 6; node 2 a leaf
DIST_PARENTS = np.array([-1, -1, -1, 0, 0, 1, 1])
DIST_VOCAB = 8
DIST_ROWS = 24000


def distribution_setup() -> tuple[torch.Tensor, np.ndarray]:
    """Fixed target logits at the root and at every node, and the node tokens (siblings distinct;
    the root's candidates each hold p > 0.1 so every conditional has thousands of samples, and
    none is the root's most likely token, so the rank order matters)."""
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(len(DIST_PARENTS) + 1, DIST_VOCAB, generator=generator)
    p_root = torch.softmax(logits[0], dim=-1)
    order = torch.argsort(p_root, descending=True).tolist()
    tokens = np.zeros(len(DIST_PARENTS), dtype=np.int64)
    tokens[:3] = [order[2], order[1], order[3]]
    assert (p_root[tokens[:3]] > 0.1).all()
    for parent in range(3):
        p_node = torch.softmax(logits[parent + 1], dim=-1)
        ranked = torch.argsort(p_node, descending=True).tolist()
        kids = [k for k in range(len(DIST_PARENTS)) if DIST_PARENTS[k] == parent]
        tokens[kids] = ranked[1 : 1 + len(kids)]
    return logits, tokens


def sample_tree(logits: torch.Tensor, tokens: np.ndarray, seed: int):
    """DIST_ROWS identical sampled rows of the tree, each with its own generator."""
    metadata = SpecDecodeMetadata.from_drafts([tokens] * DIST_ROWS)
    generators = [torch.Generator().manual_seed(seed + row) for row in range(DIST_ROWS)]
    draws = draw_random(generators, metadata, DIST_VOCAB, CPU)
    is_greedy = torch.zeros(DIST_ROWS, dtype=torch.bool)
    return accept_tree(metadata, [DIST_PARENTS] * DIST_ROWS, logits.repeat(DIST_ROWS, 1), is_greedy, draws=draws)


def pvalue(samples: np.ndarray, p: torch.Tensor) -> float:
    """Chi-square of token counts against p; cells with expected count < 5 pooled into one."""
    expected = p.double().numpy() * len(samples)
    observed = np.bincount(samples, minlength=len(expected)).astype(float)
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def conditional_pvalues(logits, tokens, output, accepted_nodes) -> list[float]:
    """First emitted token against p at the root; given the first token is node k's (k = 0, 1, 2),
    the second against p at node k."""
    p = torch.softmax(logits, dim=-1)
    pvalues = [pvalue(output[:, 0], p[0])]
    for node in range(3):
        given = output[:, 0] == tokens[node]
        assert given.sum() > 1000
        assert (accepted_nodes[given, 0] == node).all(), "a candidate's token is emitted only by accepting it"
        pvalues.append(pvalue(output[given, 1], p[node + 1]))
    return pvalues


def test_sampled_tree_follows_target_distribution():
    logits, tokens = distribution_setup()
    output, num_accepted, accepted_nodes = (t.numpy() for t in sample_tree(logits, tokens, seed=10_000))
    # the emitted prefix is a root path of the tree, its tokens the nodes' tokens
    children = children_of(DIST_PARENTS)
    for row in range(0, DIST_ROWS, 97):
        nodes = accepted_nodes[row, : num_accepted[row]].tolist()
        assert nodes == (path_to(DIST_PARENTS, nodes[-1]) if nodes else [])
        assert output[row, : len(nodes)].tolist() == tokens[nodes].tolist()
        assert output[row, len(nodes)] >= 0 and (output[row, len(nodes) + 1 :] == -1).all()
        last_children = children[nodes[-1] + 1 if nodes else 0]
        assert output[row, len(nodes)] not in tokens[last_children]
    assert set(np.unique(num_accepted)) == {0, 1, 2}
    pvalues = conditional_pvalues(logits, tokens, output, accepted_nodes)
    assert min(pvalues) > 1e-3, pvalues


def test_broken_sibling_rule_is_detected(monkeypatch):
    """Accepting each sibling with probability p(x_j), without taking the rejected siblings' mass out
    of the remaining mass, under-samples the later siblings: the same chi-square must reject it."""

    def broken(children, p_child, uniform):
        for child in children:
            if float(uniform[child]) < float(p_child[child]):
                return child
        return None

    monkeypatch.setattr(tree_acceptance, "_sampled_child", broken)
    logits, tokens = distribution_setup()
    output, _, accepted_nodes = (t.numpy() for t in sample_tree(logits, tokens, seed=10_000))
    pvalues = conditional_pvalues(logits, tokens, output, accepted_nodes)
    assert pvalues[0] < 1e-6, pvalues


def test_bad_inputs_name_the_argument():
    tokens = [np.array([1, 2]), np.array([3])]
    metadata = SpecDecodeMetadata.from_drafts(tokens)
    parents = [np.array([-1, -1]), np.array([-1])]
    logits = torch.zeros(5, VOCAB)
    greedy, sampled = torch.ones(2, dtype=torch.bool), torch.tensor([True, False])
    with pytest.raises(ValueError, match="parents"):
        accept_tree(metadata, parents[:1], logits, greedy)
    with pytest.raises(ValueError, match=r"parents\[1\]"):
        accept_tree(metadata, [parents[0], np.array([-1, 0])], logits, greedy)
    with pytest.raises(ValueError, match=r"parents\[0\]"):
        accept_tree(metadata, [np.array([1, -1]), parents[1]], logits, greedy)
    with pytest.raises(ValueError, match="logits"):
        accept_tree(metadata, parents, torch.zeros(4, VOCAB), greedy)
    with pytest.raises(ValueError, match="draws"):
        accept_tree(metadata, parents, logits, sampled)
    bad_draws = RandomDraws(uniform=torch.zeros(2), exponential=torch.ones(2, VOCAB))
    with pytest.raises(ValueError, match="draws"):
        accept_tree(metadata, parents, logits, sampled, draws=bad_draws)
