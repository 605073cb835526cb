"""method="layer_skip": the target drafts with its first N layers on its own (shared) KV cache.

The tiny target has 4 layers whose last two are scaled down, so the early exit after 1..3 layers
agrees with the full model often (drafts accepted) but not always (drafts rejected).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    build_small_vocab_llama,
    build_tiny_llama,
    left_padded_batch,
    new_tokens,
    plain_generate,
    repeated_span_batch,
)
from test_sampling_distribution import SETTINGS, chi_square_pvalue, exact_distribution, speculative_samples
from transformers import LlamaConfig, LlamaForCausalLM

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.drafters import LayerSkipProposer

NUM_LAYERS = 4


def build_target(num_layers: int = NUM_LAYERS, weak_from: int = 2, scale: float = 0.3) -> LlamaForCausalLM:
    """Tiny Llama whose layers from `weak_from` on add little to the residual stream."""
    model = build_tiny_llama(num_hidden_layers=num_layers)
    with torch.no_grad():
        for layer in model.model.layers[weak_from:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    return model


def truncated_copy(model: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A separate model made of the first `num_layers` layers, the final norm and the head."""
    copy = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": num_layers})).eval()
    copy.load_state_dict(
        {
            name: value
            for name, value in model.state_dict().items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
        }
    )
    return copy


def layer_skip_config(early_exit_layer: int = 2, k: int = 4, **extra) -> dict:
    return {
        "method": "layer_skip",
        "early_exit_layer": early_exit_layer,
        "num_speculative_tokens": k,
        **extra,
    }


@pytest.fixture(scope="module")
def target():
    return hf_specdec.enable(build_target())


@pytest.mark.parametrize(
    "batch_size,k,early_exit_layer",
    [(1, 1, 2), (1, 4, 2), (4, 1, 2), (4, 4, 2), (4, 4, 1), (4, 4, 3), (1, 6, 3)],
)
def test_greedy_matches_plain_generate(target, batch_size, k, early_exit_layer):
    inputs = repeated_span_batch(batch_size)
    plain = plain_generate(target, **inputs, max_new_tokens=40, do_sample=False)
    out = target.generate(
        **inputs,
        max_new_tokens=40,
        do_sample=False,
        speculative_config=layer_skip_config(early_exit_layer, k),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    metrics = out.spec_metrics
    assert metrics["num_accepted_tokens"] > 0, "no draft was ever accepted: the test proves nothing"
    assert metrics["num_draft_tokens"] > metrics["num_accepted_tokens"], "no draft was ever rejected"
    assert metrics["num_draft_tokens"] <= k * metrics["num_drafts"]


def test_drafts_are_the_early_exit_models_greedy_continuation(target, monkeypatch):
    """The drafter reads the K/V the target wrote for layers 0..N-1 and writes its own beyond:
    its drafts must be exactly what a separate N-layer model generates from each context, and
    it must hand the cache back to the loop with every row's length unchanged."""
    early_exit_layer = 2
    reference = truncated_copy(target, early_exit_layer)
    calls = []
    original = LayerSkipProposer.propose

    def recording_propose(self, request):
        before = [self.cache.seq_lens.get(row, 0) for row in request.rows]
        proposal = original(self, request)
        assert [self.cache.seq_lens.get(row, 0) for row in request.rows] == before
        calls.append(([t.copy() for t in request.token_ids], proposal.draft_token_ids))
        return proposal

    monkeypatch.setattr(LayerSkipProposer, "propose", recording_propose)
    inputs = repeated_span_batch(3)
    plain = plain_generate(target, **inputs, max_new_tokens=30, do_sample=False)
    out = target.generate(
        **inputs,
        max_new_tokens=30,
        do_sample=False,
        speculative_config=layer_skip_config(early_exit_layer, 4),
    )
    assert torch.equal(out, plain)
    checked = 0
    for contexts, drafts in calls:
        for context, drafted in zip(contexts, drafts):
            if len(drafted) == 0:
                continue
            expected = reference.generate(
                input_ids=torch.from_numpy(context)[None],
                max_new_tokens=len(drafted),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD_TOKEN_ID,
            )[0, len(context) :]
            assert drafted.tolist() == expected.tolist()
            checked += 1
    assert checked >= 10


def test_rows_finishing_early(target):
    """Finished rows free their blocks in the shared cache; the others keep drafting correctly."""
    inputs = repeated_span_batch(4)
    width = inputs["input_ids"].shape[1]
    baseline = new_tokens(plain_generate(target, **inputs, max_new_tokens=30, do_sample=False), width)
    eos = [EOS_TOKEN_ID, int(baseline[0, 5]), int(baseline[3, 12])]
    plain = plain_generate(target, **inputs, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    out = target.generate(
        **inputs, max_new_tokens=30, do_sample=False, eos_token_id=eos, speculative_config=layer_skip_config()
    )
    assert torch.equal(out, plain)
    assert (new_tokens(plain, width) == PAD_TOKEN_ID).any(), "no row finished early"


def test_ragged_rows_near_max_length(target):
    inputs = left_padded_batch([[5, 6, 7] * 7, [9, 10], [11, 12, 13, 11, 12, 13, 11]])
    for max_new_tokens in (1, 2, 9):
        plain = plain_generate(target, **inputs, max_new_tokens=max_new_tokens, do_sample=False)
        out = target.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            speculative_config=layer_skip_config(3, k=8, block_size=4),
        )
        assert torch.equal(out, plain), max_new_tokens


def test_sampled_drafts_follow_the_target_distribution():
    """Sampling: drafts are sampled from the early exit's q; the output follows the target's p."""
    model = hf_specdec.enable(build_small_vocab_llama())
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_distribution(model, sampling)
    samples, metrics = speculative_samples(
        model, sampling, layer_skip_config(1, k=3), num_samples=4000, seed=99
    )
    assert all(0 < m["num_accepted_tokens"] < m["num_draft_tokens"] for m in metrics)
    assert chi_square_pvalue(samples, exact) > 1e-3


# --- configuration errors ----------------------------------------------------------------------


@pytest.mark.parametrize("early_exit_layer", [NUM_LAYERS, NUM_LAYERS + 3])
def test_early_exit_layer_beyond_the_model_rejected(target, early_exit_layer):
    with pytest.raises(ValueError, match="early_exit_layer") as info:
        target.generate(
            **repeated_span_batch(1), max_new_tokens=4, speculative_config=layer_skip_config(early_exit_layer)
        )
    assert f"1 to {NUM_LAYERS - 1}" in str(info.value)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"method": "layer_skip"}, "required"),
        ({"method": "layer_skip", "early_exit_layer": 0}, ">= 1"),
        ({"method": "layer_skip", "early_exit_layer": -2}, ">= 1"),
        ({"method": "layer_skip", "early_exit_layer": 1.5}, "integer"),
        ({"method": "layer_skip", "early_exit_layer": True}, "integer"),
        ({"method": "layer_skip", "early_exit_layer": "2"}, "integer"),
        ({"method": "ngram", "early_exit_layer": 2}, "only used by method='layer_skip'"),
        ({"method": "layer_skip", "early_exit_layer": 2, "model": "some/model"}, "model must be None"),
    ],
)
def test_invalid_layer_skip_config_names_the_field(kwargs, fragment):
    with pytest.raises(ValueError, match="speculative_config") as info:
        SpeculativeConfig.from_any(kwargs)
    assert fragment in str(info.value)
    field = "model" if "model" in kwargs else "early_exit_layer"
    assert field in str(info.value)
