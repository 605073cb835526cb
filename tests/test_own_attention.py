"""Models the paged attention cannot run exactly run on their own attention and `DynamicCache`, one row
per forward (`hf_specdec/cache/own_attention.py`): BLOOM, GPT-Neo, MPT and the others the family
matrix lists. Greedy output equals plain `generate()` there (`test_family_matrix.py`, every family);
here: the mechanism on a sliding-window model (whose own cache drops and crops keys), the engine,
EAGLE-3, what stays refused and why, and a broken rollback that must show.
"""

from __future__ import annotations

import warnings

import families
import pytest
import torch
from conftest import left_padded_batch, plain_generate
from test_architectures import long_prompts, perturbed_copy, speculate, tiny_mistral
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import hf_specdec
from hf_specdec.cache.architectures import check_architecture, padded_batch_problem
from hf_specdec.cache.own_attention import (
    BatchedOwnAttentionCache,
    RowOwnAttentionCache,
    mark_own_attention,
    runs_one_row_per_forward,
    runs_own_attention,
)
from hf_specdec.cache.paged_cache import PagedKVCache
from hf_specdec.cache.prefill import check_model_prefill


def own_attention_mistral(seed_copy: bool = False):
    """A Mistral with a sliding window of 8 (shorter than the prompts), run on its own attention as if the
    paged attention could not run it: its own cache keeps sliding layers, which a rollback must crop."""
    model = tiny_mistral(sliding_window=8)
    mark_own_attention(model)
    return model


def test_sliding_window_model_on_its_own_cache_equals_plain_generate():
    """n-gram drafts (k=4, most rejected), a draft model on its own cache too (k=3, most accepted) and
    layer_skip (its drafts write the first layer only, then are cropped back): identical to plain
    generate() on a left-padded batch of 3, drafts accepted and rejected; one row per forward (a sliding
    layer's cache cannot be batched so), with a warning that this is likely slower than plain generate()
    there, in generate() and in an engine built for several requests."""
    model = own_attention_mistral()
    inputs = left_padded_batch(long_prompts(3))
    assert inputs["input_ids"].shape[1] > 8
    plain = plain_generate(model, **inputs, max_new_tokens=30, do_sample=False)
    draft = perturbed_copy(model)
    mark_own_attention(draft)
    for config in (
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
        {"method": "layer_skip", "early_exit_layer": 1, "num_speculative_tokens": 3},
    ):
        with pytest.warns(UserWarning, match="one forward per row: at batch size 3 speculative decoding is likely slower"):
            out = speculate(model, inputs, 30, **config)
        accepted, drafted = out.spec_metrics["num_accepted_tokens"], out.spec_metrics["num_draft_tokens"]
        assert torch.equal(out.sequences, plain) and 0 < accepted < drafted, (config["method"], accepted, drafted)
    cache = PagedKVCache.for_model(model, num_blocks=4)
    assert isinstance(cache, RowOwnAttentionCache) and cache.one_row_per_forward
    with pytest.warns(UserWarning, match="one forward per row: with several requests at once the engine is likely slower"):
        hf_specdec.SpeculativeEngine(model, {"method": "ngram", "num_speculative_tokens": 3}, max_batch_size=2)


def test_a_rollback_that_does_not_crop_the_rows_cache_shows(monkeypatch):
    """The broken variant: rejected drafts' keys left in the row's own cache change the output."""
    model = own_attention_mistral()
    inputs = left_padded_batch(long_prompts(3))
    plain = plain_generate(model, **inputs, max_new_tokens=30, do_sample=False)
    monkeypatch.setattr(DynamicLayer, "crop", lambda self, tokens_to_remove: None)
    monkeypatch.setattr(DynamicSlidingWindowLayer, "crop", lambda self, tokens_to_remove: None)
    out = speculate(model, inputs, 30, method="ngram", num_speculative_tokens=4)
    assert out.spec_metrics["num_draft_tokens"] > out.spec_metrics["num_accepted_tokens"]
    assert not torch.equal(out.sequences, plain)


def test_bloom_runs_batched_on_its_own_attention_in_the_engine_and_with_eagle3():
    """BLOOM (ALiBi, its attention computed in the layer itself) is found to need its own attention, and to run
    batched on one `DynamicCache` (its layers all plain `DynamicLayer`s): the engine gives each of three
    requests plain generate()'s tokens for its prompt alone, two at a time (one joining mid-flight, the third
    taking a finished one's slot); an EAGLE-3 head bound to it drafts, identical too; no warning of one
    forward per row; draft trees and image inputs are refused with the reason."""
    model = hf_specdec.enable(families.build_tiny_model("bloom"))
    check_architecture(model)
    assert runs_own_attention(model) and not runs_one_row_per_forward(model)
    prompts = long_prompts(3, lengths=(23, 35, 29))
    expected = [
        plain_generate(model, input_ids=torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    config = {"method": "draft_model", "model": perturbed_copy(model), "num_speculative_tokens": 3}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = hf_specdec.SpeculativeEngine(model, config, max_batch_size=2)
    assert not [w for w in caught if "one forward per row" in str(w.message)]
    assert isinstance(engine.cache, BatchedOwnAttentionCache)
    first = engine.add_request(prompts[0], {"max_new_tokens": 20, "do_sample": False})
    outputs = list(engine.step()) + list(engine.step())
    second = engine.add_request(prompts[1], {"max_new_tokens": 20, "do_sample": False})
    third = engine.add_request(prompts[2], {"max_new_tokens": 20, "do_sample": False})
    for _ in range(90):
        outputs += engine.step()
    finished = {o.request_id: o.token_ids for o in outputs if o.finished}
    assert finished == {first: expected[0], second: expected[1], third: expected[2]}
    assert engine.num_kv_blocks_used == 0 and engine.metrics.num_accepted_tokens > 0

    inputs = left_padded_batch(prompts)
    plain = plain_generate(model, **inputs, max_new_tokens=20, do_sample=False)
    head = hf_specdec.EagleHead.for_target(model, "eagle3", seed=0)
    out = speculate(model, inputs, 20, method="eagle3", model=head, num_speculative_tokens=2)
    assert torch.equal(out.sequences, plain) and out.spec_metrics["num_draft_tokens"] > 0
    with pytest.raises(ValueError, match="speculative_config.tree is not supported on models with their own attention"):
        speculate(model, inputs, 20, tree={"num_nodes": 8, "topk": 2})
    with pytest.raises(ValueError, match=r"model inputs \['pixel_values'\] are not supported for model_type='bloom': it runs on its own"):
        check_model_prefill(model, {"pixel_values": torch.zeros(1, 3, 8, 8)})


def test_a_batch_whose_left_padding_the_model_sees_differs(monkeypatch):
    """The broken variant of the batched cache: rows realigned after a rejection, their left padding left
    visible to the model's attention (an all-ones mask), no longer give plain generate()'s tokens."""
    model = families.build_tiny_model("bloom")
    inputs = left_padded_batch(long_prompts(3))
    plain = plain_generate(model, **inputs, max_new_tokens=30, do_sample=False)
    out = speculate(model, inputs, 30, method="ngram", num_speculative_tokens=4)
    assert torch.equal(out.sequences, plain) and 0 < out.spec_metrics["num_accepted_tokens"]
    model_inputs = BatchedOwnAttentionCache.model_inputs

    def unmasked(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict:
        return {**model_inputs(self, input_ids, position_ids), "attention_mask": torch.ones_like(self._mask)}

    monkeypatch.setattr(BatchedOwnAttentionCache, "model_inputs", unmasked)
    out = speculate(model, inputs, 30, method="ngram", num_speculative_tokens=4)
    assert not torch.equal(out.sequences, plain)


def test_what_its_own_attention_cannot_run_exactly_stays_refused():
    """A refusal names why each path fails: ZAYA's recurrent layers keep no per-token states to roll back."""
    model = families.build_tiny_model("zaya")
    reason = "on its own attention and cache: rolling its own cache back one token changes its logits"
    with pytest.raises(ValueError, match=reason):
        check_architecture(model)
    assert not runs_own_attention(model)


@pytest.mark.parametrize(("model_type", "own_attention"), [("git", True), ("whisper", False)])
def test_a_model_whose_plain_generate_misreads_padding_takes_rows_of_one_length(model_type, own_attention):
    """GIT (its mask reads the padding while decoding) and Whisper's decoder (positions counted from the
    cache, padding included): plain generate() gives a left-padded row other tokens than the row alone,
    so generate() refuses a left-padded batch naming attention_mask; the engine, whose requests run
    alone, gives each request plain generate()'s tokens for its prompt (a draft model: drafts accepted), one
    joining mid-flight."""
    model = families.build_tiny_model(model_type)
    assert padded_batch_problem(model) and runs_own_attention(model) == own_attention
    prompts = long_prompts(2, lengths=(23, 35))
    with pytest.raises(ValueError, match="attention_mask: this .* cannot take a left-padded batch exactly: "):
        speculate(model, left_padded_batch(prompts), 10)
    expected = [
        plain_generate(model, input_ids=torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    with warnings.catch_warnings():  # on its own attention: slower with several rows, said and tested above
        warnings.simplefilter("ignore", UserWarning)
        config = {"method": "draft_model", "model": perturbed_copy(model), "num_speculative_tokens": 3}
        engine = hf_specdec.SpeculativeEngine(model, config, max_batch_size=2)
    first = engine.add_request(prompts[0], {"max_new_tokens": 20, "do_sample": False})
    outputs = list(engine.step()) + list(engine.step())
    second = engine.add_request(prompts[1], {"max_new_tokens": 20, "do_sample": False})
    for _ in range(60):
        outputs += engine.step()
    finished = {o.request_id: o.token_ids for o in outputs if o.finished}
    assert finished == {first: expected[0], second: expected[1]} and engine.num_kv_blocks_used == 0
    assert engine.metrics.num_accepted_tokens > 0


@pytest.mark.parametrize(("model_type", "padded_problem"), [("git", True), ("whisper", True), ("bloom", False)])
def test_left_padding_is_checked_in_half_precision_too(model_type, padded_problem):
    """How plain generate() reads left padding is a matter of the model's code, not its precision: in bfloat16
    the check runs on float32 copies of the weights and finds what it finds in float32 (GIT and Whisper's decoder
    refuse left-padded batches, BLOOM takes them), then puts the bfloat16 weights back untouched."""
    model = families.build_tiny_model(model_type).to(torch.bfloat16)
    weights = model.state_dict()
    assert bool(padded_batch_problem(model)) == padded_problem
    after = model.state_dict()
    assert all(after[name].dtype == torch.bfloat16 and after[name].data_ptr() == weights[name].data_ptr() for name in weights)
