"""method="draft_model" with `tree`: the draft model grows an EAGLE-2 tree per row.

Greedy output equals plain generate() with a draft close to the target (its perturbed copy: long
accepted paths) and with an unrelated random draft (mostly rejected); every tree the proposer
drafts over several steps with random acceptance equals a cache-free reference built from full
forwards of the draft model; the tree accepts more than the chain; sampled output follows the
target's exact distribution.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    build_small_vocab_llama,
    build_tiny_llama,
    left_padded_batch,
    new_tokens,
    plain_generate,
    repeated_span_batch,
    repeated_span_prompts,
)
from test_draft_model import perturbed_copy
from test_sampling_distribution import SETTINGS, chi_square_pvalue, exact_distribution, speculative_samples
from transformers import TemperatureLogitsWarper, TopKLogitsWarper

import hf_specdec
from hf_specdec.config import TreeSpec
from hf_specdec.drafters import DraftModelProposer, DraftSampling, ProposeRequest
from hf_specdec.sampling.tree import check_tree, children_of, path_to

DYNAMIC = {"num_nodes": 12, "topk": 3}
STATIC = {"static": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]}


def tree_config(draft, tree: dict | None, k: int = 4, **extra) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "tree": tree, **extra}


@pytest.fixture(scope="module")
def target():
    return hf_specdec.enable(build_tiny_llama())


@pytest.fixture(scope="module")
def drafts(target):
    unrelated = build_tiny_llama(seed=5, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    return {"perturbed": perturbed_copy(target), "unrelated": unrelated}


# --- greedy identity ---------------------------------------------------------------------------


@pytest.mark.parametrize("tree", (DYNAMIC, STATIC), ids=("dynamic", "static"))
@pytest.mark.parametrize("batch_size", (1, 3))
@pytest.mark.parametrize("draft_name", ("perturbed", "unrelated"))
def test_greedy_matches_plain_generate(target, drafts, draft_name, batch_size, tree):
    inputs = repeated_span_batch(batch_size)
    plain = plain_generate(target, **inputs, max_new_tokens=30, do_sample=False)
    out = target.generate(
        **inputs, max_new_tokens=30, do_sample=False, return_dict_in_generate=True,
        speculative_config=tree_config(drafts[draft_name], tree),
    )
    assert torch.equal(out.sequences, plain)
    metrics = out.spec_metrics
    assert metrics["num_draft_tokens"] > metrics["num_drafts"] * 4, "trees should hold more nodes than a chain of 4"
    assert metrics["num_draft_tokens"] > metrics["num_accepted_tokens"]
    if draft_name == "perturbed":
        assert metrics["mean_acceptance_length"] > 2


def test_rows_finish_inside_a_tree_path(target, drafts):
    """EOS on a branch, max_new_tokens ending inside an accepted path; a wide tree (more fed nodes
    than k) exercises the draft pool's sizing up to the last token."""
    draft = drafts["perturbed"]
    inputs = left_padded_batch(repeated_span_prompts(5, seed=3))
    width = inputs["input_ids"].shape[1]
    plain_full = plain_generate(target, **inputs, max_new_tokens=30, do_sample=False)
    eos = int(plain_full[1, -12])  # a token row 1 emits late: rows stop on it wherever it comes
    for max_new_tokens in (7, 13, 30):
        plain = plain_generate(target, **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos)
        for tree in (DYNAMIC, STATIC, {"num_nodes": 40, "topk": 8}):
            out = target.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                return_dict_in_generate=True, speculative_config=tree_config(draft, tree, k=5),
            )
            assert torch.equal(out.sequences, plain), (max_new_tokens, tree)
            assert out.spec_metrics["num_accepted_tokens"] > 0
    assert (new_tokens(plain, width) == 0).any(), "no row finished early"


def test_tree_accepts_more_than_the_chain(target, drafts):
    inputs = repeated_span_batch(6, seed=2)
    plain = plain_generate(target, **inputs, max_new_tokens=40, do_sample=False)
    tau = {}
    for name, tree in (("chain", None), ("dynamic", {"num_nodes": 16, "topk": 4}), ("static", STATIC)):
        out = target.generate(
            **inputs, max_new_tokens=40, do_sample=False, return_dict_in_generate=True,
            speculative_config=tree_config(drafts["perturbed"], tree),
        )
        assert torch.equal(out.sequences, plain), name
        tau[name] = out.spec_metrics["mean_acceptance_length"]
    assert tau["dynamic"] > tau["chain"] + 0.1, tau
    assert tau["static"] > tau["chain"] + 0.1, tau


# --- the proposer on its own: every tree against a cache-free reference ---------------------------


def reference_tree(draft, context: np.ndarray, spec: TreeSpec, wanted: int, warpers) -> dict[tuple[int, ...], float]:
    """{token path: score} of the tree EAGLE-2 grows with full forwards of `draft` (no cache)."""
    static = None if spec.static_paths is None else set(spec.static_paths)
    nodes: dict[tuple[int, ...], tuple[float, tuple[int, ...]]] = {}  # token path -> (score, rank path)

    def expand(tokens: tuple[int, ...], score: float, ranks: tuple[int, ...]) -> None:
        with torch.no_grad():
            logits = draft(input_ids=torch.tensor([[*context.tolist(), *tokens]])).logits[:, -1].float()
        for warper in warpers:
            logits = warper(None, logits)
        values, ids = torch.log_softmax(logits[0], dim=-1).topk(spec.topk)
        for rank, (token, value) in enumerate(zip(ids.tolist(), values.tolist())):
            if value > -np.inf and (static is None or (*ranks, rank) in static):
                nodes[(*tokens, token)] = (score + value, (*ranks, rank))

    expand((), 0.0, ())
    for depth in range(1, min(wanted, spec.depth)):
        level = [path for path in nodes if len(path) == depth]
        if static is None:
            level = sorted(level, key=lambda p: -nodes[p][0])[: spec.topk]
        else:
            level = [p for p in level if any(len(s) > depth and s[:depth] == nodes[p][1] for s in static)]
        for path in level:
            expand(path, *nodes[path])
    kept = list(nodes)
    if static is None:
        kept = sorted(kept, key=lambda p: (-nodes[p][0], len(p)))[: spec.num_nodes]
    return {path: nodes[path][0] for path in kept}


@pytest.mark.parametrize("tree", (DYNAMIC, STATIC), ids=("dynamic", "static"))
@pytest.mark.parametrize("warped", (False, True), ids=("greedy", "warped"))
def test_trees_equal_a_cache_free_reference(drafts, tree, warped):
    """Over several steps with random acceptance along a tree path (or none), every row's tree is
    what full forwards of the draft over context + path give: the tree mask, the node positions and
    the rollback of the previous call's nodes are right. Sampled rows rank by the warped scores."""
    draft, k = drafts["perturbed"], 4
    spec = TreeSpec.parse(tree, k)
    warpers = [TemperatureLogitsWarper(1.3), TopKLogitsWarper(3)] if warped else []
    sampling = DraftSampling(do_sample=warped, warpers=warpers)
    proposer = DraftModelProposer(draft, k, sampling, block_size=4, max_length=80, tree=spec)
    rng = np.random.default_rng(0)
    contexts = [np.array(p, dtype=np.int64) for p in repeated_span_prompts(3, seed=5)]
    for _ in range(5):
        max_draft = [int(rng.integers(0, k + 1)) for _ in contexts]
        proposal = proposer.propose(ProposeRequest(rows=[0, 1, 2], token_ids=contexts, max_draft_tokens=max_draft))
        assert proposal.draft_probs is None
        for row, (context, tokens, parents) in enumerate(zip(contexts, proposal.draft_token_ids, proposal.draft_parents)):
            if max_draft[row] == 0:
                assert len(tokens) == 0 and len(parents) == 0
                continue
            check_tree(tokens, parents)
            paths = {tuple(tokens[path_to(parents, node)].tolist()): node for node in range(len(tokens))}
            expected = reference_tree(draft, context, spec, max_draft[row], warpers)
            assert set(paths) == set(expected), row
            for siblings in children_of(parents):  # ranked best first
                scores = [expected[tuple(tokens[path_to(parents, node)].tolist())] for node in siblings]
                assert scores == sorted(scores, reverse=True)
        # accept a random path of each row's tree and append a random "target" token
        for row, (tokens, parents) in enumerate(zip(proposal.draft_token_ids, proposal.draft_parents)):
            path = path_to(parents, int(rng.integers(-1, len(tokens)))) if len(tokens) else []
            contexts[row] = np.concatenate([contexts[row], tokens[path], [int(rng.integers(3, 128))]])
    proposer.release([0, 1, 2])
    assert proposer.cache.num_blocks_used == 0 and not proposer.cached_tokens


# --- sampling: the exact distribution --------------------------------------------------------------


def test_sampling_matches_exact_distribution():
    """Ranked one-hot candidates of a draft with other weights, children ranked by the warped
    draft distribution: the output follows the processed target distribution."""
    target = hf_specdec.enable(build_small_vocab_llama(0))
    draft = build_small_vocab_llama(1)
    sampling = SETTINGS["temperature_topk_topp"]
    samples, metrics = speculative_samples(
        target, sampling, tree_config(draft, {"num_nodes": 24, "topk": 8}, k=3), num_samples=6000, seed=11, rows=1000
    )
    assert all(m["num_accepted_tokens"] > 0 for m in metrics)
    assert chi_square_pvalue(samples, exact_distribution(target, sampling)) > 1e-3
