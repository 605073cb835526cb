"""Draft trees in generate(): exact greedy output, the exact sampled distribution, the KV cache
after a tree step, and trees actually accepting more than chains.

Random EAGLE heads draft mostly nonsense (exactness under rejection, many branches dropped); the
head trained on the tiny target's text (test_eagle.train_head) shows the tree paying: a longer mean
accepted length than its chain at the same depth.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import (
    build_small_vocab_llama,
    build_tiny_llama,
    left_padded_batch,
    plain_generate,
    repeated_span_batch,
)
from test_eagle import TRAINED_TARGET_INIT, _random_prompts, random_head, train_head
from test_sampling_distribution import SETTINGS, chi_square_pvalue, exact_distribution, speculative_samples
from transformers import LogitsProcessorList

import hf_specdec
from hf_specdec.loop import engine
from hf_specdec.sampling import tree_acceptance
from hf_specdec.sampling.penalties import OutputTokenPenalties

DYNAMIC = {"num_nodes": 12, "topk": 3}
STATIC = {"static": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]}


def tree_config(head, tree: dict, k: int = 4, method: str = "eagle3") -> dict:
    return {"method": method, "model": head, "num_speculative_tokens": k, "tree": tree}


@pytest.mark.parametrize("tree", (DYNAMIC, STATIC), ids=("dynamic", "static"))
@pytest.mark.parametrize("batch_size", (1, 3))
@pytest.mark.parametrize("method", ("eagle", "eagle3"))
def test_greedy_matches_plain_generate(enabled_llama, method, batch_size, tree):
    model = enabled_llama
    inputs = repeated_span_batch(batch_size)
    plain = plain_generate(model, **inputs, max_new_tokens=23, do_sample=False)
    out = model.generate(
        **inputs, max_new_tokens=23, do_sample=False, return_dict_in_generate=True,
        speculative_config=tree_config(random_head(model, method), tree, method=method),
    )
    assert torch.equal(out.sequences, plain)
    metrics = out.spec_metrics
    assert metrics["num_draft_tokens"] > metrics["num_drafts"] * 4, "trees should hold more nodes than a chain of 4"
    assert metrics["num_draft_tokens"] > metrics["num_accepted_tokens"]


def test_rows_finish_inside_a_tree_path(monkeypatch):
    """EOS on a branch, max_new_tokens ending inside an accepted path: a trained head accepts long paths."""
    model = hf_specdec.enable(build_tiny_llama(initializer_range=TRAINED_TARGET_INIT))
    model.requires_grad_(False)
    head = train_head(model, "eagle3", steps=150)
    inputs = left_padded_batch(_random_prompts(5, seed=3, lengths=(4, 11)))
    plain_full = plain_generate(model, **inputs, max_new_tokens=30, do_sample=False)
    eos = int(plain_full[1, -12])  # a token row 1 emits late: rows stop on it wherever it comes
    model.generation_config.eos_token_id = eos
    for max_new_tokens in (13, 30):
        plain = plain_generate(model, **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos)
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, return_dict_in_generate=True,
            speculative_config=tree_config(head, DYNAMIC),
        )
        assert torch.equal(out.sequences, plain), max_new_tokens


def test_trained_head_accepts_more_with_a_tree():
    model = hf_specdec.enable(build_tiny_llama(initializer_range=TRAINED_TARGET_INIT))
    model.requires_grad_(False)
    head = train_head(model, "eagle3", steps=150)
    inputs = left_padded_batch(_random_prompts(8, seed=1, lengths=(5, 12)))
    plain = plain_generate(model, **inputs, max_new_tokens=40, do_sample=False)
    tau = {}
    for name, tree in (("chain", None), ("tree", {"num_nodes": 16, "topk": 4})):
        out = model.generate(
            **inputs, max_new_tokens=40, do_sample=False, return_dict_in_generate=True,
            speculative_config=tree_config(head, tree, k=4),
        )
        assert torch.equal(out.sequences, plain), name
        tau[name] = out.spec_metrics["mean_acceptance_length"]
    assert tau["tree"] > tau["chain"] + 0.1, tau


def _kv_checked_step(reference, checked: list[int]):
    """speculative_step, followed by a check that every unfinished row's cached K/V equal what a
    plain forward of `reference` (a copy of the target outside generate) over its accepted tokens
    computes, read from the pool through the row's block table."""
    step = engine.speculative_step

    def checked_step(model, state, proposer, cache, *args, **kwargs):
        emitted = step(model, state, proposer, cache, *args, **kwargs)
        for row in state.active_rows():
            length = int(state.num_cached[row])
            tokens = state.token_buffer[row, state.pad_lens[row] : state.pad_lens[row] + length]
            with torch.no_grad():
                plain_cache = reference.model(input_ids=tokens[None], use_cache=True).past_key_values
            slots = cache._slots(int(row), np.arange(length))
            for index, layer in enumerate(cache.layers):
                keys = layer.keys.view(-1, *layer.keys.shape[-2:])[torch.from_numpy(slots)]
                torch.testing.assert_close(keys.transpose(0, 1), plain_cache.layers[index].keys[0], atol=1e-5, rtol=1e-4)
                values = layer.values.view(-1, *layer.values.shape[-2:])[torch.from_numpy(slots)]
                torch.testing.assert_close(values.transpose(0, 1), plain_cache.layers[index].values[0], atol=1e-5, rtol=1e-4)
            checked.append(length)
        return emitted

    return checked_step


def test_cache_after_tree_steps_equals_plain_decoding(monkeypatch):
    model = hf_specdec.enable(build_tiny_llama(initializer_range=TRAINED_TARGET_INIT))
    model.requires_grad_(False)
    head = train_head(model, "eagle3", steps=150)
    checked: list[int] = []
    monkeypatch.setattr(engine, "speculative_step", _kv_checked_step(copy.deepcopy(model), checked))
    inputs = left_padded_batch(_random_prompts(3, seed=2, lengths=(6, 10)))
    out = model.generate(
        **inputs, max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
        speculative_config=tree_config(head, DYNAMIC),
    )
    assert len(checked) >= 10
    assert out.spec_metrics["num_accepted_tokens"] > 0


# --- sampling: the exact distribution --------------------------------------------------------------
# 8 candidates per node out of 16 tokens: siblings hold most of the mass, so how a rejected sibling's
# mass is handled decides the output (the broken variant below then fails by far)
SAMPLING_TREE = {"num_nodes": 24, "topk": 8}

def _tree_samples(model, sampling: dict, tree: dict) -> tuple[np.ndarray, list[dict]]:
    head = random_head(model, "eagle3", seed=1)
    return speculative_samples(
        model, sampling, tree_config(head, tree, k=3), num_samples=6000, seed=11, rows=1000
    )


@pytest.mark.parametrize("setting", ("temperature_topk_topp", "minp_repetition_penalty"))
def test_sampling_matches_exact_distribution(setting):
    """Candidates tried in rank order with the target's residual: output follows the processed
    target distribution, with processors (repetition penalty) seeing each node's own path."""
    model = hf_specdec.enable(build_small_vocab_llama())
    sampling = SETTINGS[setting]
    samples, metrics = _tree_samples(model, sampling, SAMPLING_TREE)
    accepted = sum(m["num_accepted_tokens"] for m in metrics)
    assert accepted > 0
    assert chi_square_pvalue(samples, exact_distribution(model, sampling)) > 1e-3


def test_sampling_test_detects_a_broken_tree_acceptance(monkeypatch):
    """The same test fails when a rejected sibling's probability is not removed before the next is tried."""
    model = hf_specdec.enable(build_small_vocab_llama())
    sampling = SETTINGS["temperature_topk_topp"]

    def without_residual(children, p_child, uniform):  # each sibling accepted with its own p, mass never removed
        return next((c for c in children if float(uniform[c]) < float(p_child[c])), None)

    monkeypatch.setattr(tree_acceptance, "_sampled_child", without_residual)
    samples, _ = _tree_samples(model, sampling, SAMPLING_TREE)
    assert chi_square_pvalue(samples, exact_distribution(model, sampling)) < 1e-6


@pytest.mark.parametrize("tree", ({"num_nodes": 10, "topk": 3}, {"static": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}),
                         ids=("dynamic", "static"))
@pytest.mark.parametrize("batch_size", (1, 3))
def test_ngram_trees_match_plain_generate(enabled_llama, batch_size, tree):
    """Several earlier matches merged into a token tree: exact, and accepting."""
    inputs = repeated_span_batch(batch_size, seed=4)
    plain = plain_generate(enabled_llama, **inputs, max_new_tokens=30, do_sample=False)
    out = enabled_llama.generate(
        **inputs, max_new_tokens=30, do_sample=False, return_dict_in_generate=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "tree": tree},
    )
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_accepted_tokens"] > 0


@pytest.mark.parametrize("processor", ("repetition_penalty", "no_repeat_ngram_size", "output_token_penalties"))
def test_prefix_reading_processors_see_each_nodes_path(enabled_llama, processor):
    """Left-padded rows (the repetition penalty holds one prompt length per batch row: each node
    must get its row's) and processors reading the prefix: every node is processed for its own path."""
    inputs = repeated_span_batch(3, seed=4)
    options = {
        "repetition_penalty": {"repetition_penalty": 1.5},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 3},
        "output_token_penalties": {"logits_processor": LogitsProcessorList(
            [OutputTokenPenalties(0.3, 0.2, prompt_width=inputs["input_ids"].shape[1])]
        )},
    }[processor]  # fmt: skip
    plain = plain_generate(enabled_llama, **inputs, max_new_tokens=30, do_sample=False, **options)
    assert not torch.equal(plain, plain_generate(enabled_llama, **inputs, max_new_tokens=30, do_sample=False))
    out = enabled_llama.generate(
        **inputs, max_new_tokens=30, do_sample=False, return_dict_in_generate=True, **options,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "tree": {"num_nodes": 8, "topk": 2}},
    )
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_accepted_tokens"] > 0


def test_trees_refused_where_they_cannot_be_exact():
    import families
    from test_architectures import speculate

    inputs = left_padded_batch([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]], pad_token_id=families.PAD_TOKEN_ID)
    mistral = families.build_tiny_model("mistral")
    with pytest.raises(ValueError, match="tree is not supported on models with sliding-window"):
        speculate(mistral, inputs, 4, tree={"num_nodes": 4})
    hybrid = families.build_tiny_model("jamba")
    with pytest.raises(ValueError, match="tree is not supported on models with recurrent layers"):
        speculate(hybrid, inputs, 4, tree={"num_nodes": 4})


def test_eos_on_a_side_branch_does_not_stop_the_row(enabled_llama, monkeypatch):
    """Every tree gets an extra last-ranked child of the root holding the EOS token: rows must stop
    only where plain generate() emits EOS, never because a rejected branch held it."""
    inputs = repeated_span_batch(3, seed=4)
    plain_full = plain_generate(enabled_llama, **inputs, max_new_tokens=30, do_sample=False)
    eos = int(plain_full[0, -5])  # row 0 emits it late; the side branches offer it at every step
    plain = plain_generate(enabled_llama, **inputs, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    offered = []
    build = engine.build_proposer

    class EosBranch:
        def __init__(self, inner):
            self.inner = inner

        def propose(self, request):
            proposal = self.inner.propose(request)
            for i, (tokens, parents) in enumerate(zip(proposal.draft_token_ids, proposal.draft_parents)):
                if request.max_draft_tokens[i] > 0 and eos not in tokens[parents < 0]:
                    proposal.draft_token_ids[i] = np.append(tokens, eos)
                    proposal.draft_parents[i] = np.append(parents, -1)
                    offered.append(i)
            return proposal

        def release(self, rows, token_ids=None):
            self.inner.release(rows, token_ids)

    monkeypatch.setattr(engine, "build_proposer", lambda *a, **k: EosBranch(build(*a, **k)))
    out = enabled_llama.generate(
        **inputs, max_new_tokens=30, do_sample=False, eos_token_id=eos, return_dict_in_generate=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "tree": {"num_nodes": 6, "topk": 2}},
    )
    assert torch.equal(out.sequences, plain)
    assert len(offered) > 10
