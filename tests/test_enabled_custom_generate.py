"""`custom_generate=hf_specdec.generate` on a model that `enable()` patched (issue 38: both README
snippets run in one notebook). It is the same loop, so it takes the enabled path: the same
sequences, metrics, streamed tokens and stop strings. Anyone else's `custom_generate` together
with `speculative_config` is still refused, with a message that says what is allowed.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    PAD_TOKEN_ID,
    build_tiny_llama,
    new_tokens,
    ngram_config,
    plain_generate,
    repeated_span_batch,
)
from test_stopping import CollectingStreamer

import hf_specdec

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")


def test_our_callable_equals_the_enabled_path(enabled_llama):
    model = enabled_llama
    inputs = repeated_span_batch(3)
    kwargs = dict(max_new_tokens=32, do_sample=False, return_dict_in_generate=True)
    enabled = model.generate(**inputs, **kwargs, speculative_config=ngram_config(4, 1, 4))
    both = model.generate(
        **inputs, **kwargs, custom_generate=hf_specdec.generate, speculative_config=ngram_config(4, 1, 4)
    )
    assert torch.equal(both.sequences, enabled.sequences)
    assert torch.equal(both.sequences, plain_generate(model, **inputs, max_new_tokens=32, do_sample=False))
    for key in COUNTERS:
        assert both.spec_metrics[key] == enabled.spec_metrics[key], key
    assert both.spec_metrics["num_accepted_tokens"] > 0


def test_our_callable_keeps_streamer_and_stop_strings(enabled_llama, word_tokenizer):
    """transformers drops `streamer=` and `tokenizer=` for custom callables: on an enabled model
    they are carried across for ours as for the enabled path."""
    model = enabled_llama
    inputs = repeated_span_batch(1)
    width = inputs["input_ids"].shape[1]
    baseline = new_tokens(plain_generate(model, **inputs, max_new_tokens=36, do_sample=False), width)[
        0
    ].tolist()
    kwargs = dict(
        max_new_tokens=36,
        do_sample=False,
        stop_strings=[f"w{baseline[9]}w{baseline[10]}"],
        tokenizer=word_tokenizer,
    )
    plain = plain_generate(model, **inputs, **kwargs)
    assert plain.shape[1] - width < 36, "the stop string never ended generation"

    results = {}
    for path, extra in (("enabled", {}), ("custom_generate", {"custom_generate": hf_specdec.generate})):
        streamer = CollectingStreamer()
        out = model.generate(
            **inputs, **kwargs, **extra, streamer=streamer, speculative_config=ngram_config(4, 1, 3)
        )
        assert torch.equal(out, plain), path
        assert streamer.ended == 1 and torch.equal(streamer.values[0], inputs["input_ids"]), path
        results[path] = torch.cat([value.flatten() for value in streamer.values[1:]])
    assert torch.equal(results["custom_generate"], results["enabled"])
    assert torch.equal(results["enabled"], new_tokens(plain, width)[0])


def test_speculative_streamer_on_an_enabled_model(enabled_llama):
    """The README's `speculative_streamer=` (for the custom_generate path) works on an enabled
    model too; giving it and `streamer=` both is an error, not a silent pick."""
    model = enabled_llama
    inputs = repeated_span_batch(1)
    streamer = CollectingStreamer()
    out = model.generate(
        **inputs,
        max_new_tokens=12,
        do_sample=False,
        custom_generate=hf_specdec.generate,
        speculative_config=ngram_config(4),
        speculative_streamer=streamer,
    )
    assert streamer.ended == 1
    streamed = torch.cat([value.flatten() for value in streamer.values[1:]])
    assert torch.equal(streamed, new_tokens(out, inputs["input_ids"].shape[1])[0])
    with pytest.raises(ValueError, match="not both"):
        model.generate(
            **inputs,
            max_new_tokens=4,
            streamer=CollectingStreamer(),
            speculative_streamer=CollectingStreamer(),
            speculative_config=ngram_config(4),
        )


def test_our_callable_without_speculative_config_speculates_as_unpatched(enabled_llama):
    """No speculative_config with our callable: the defaults, as on an unpatched model."""
    inputs = repeated_span_batch(2)
    kwargs = dict(
        max_new_tokens=20, do_sample=False, custom_generate=hf_specdec.generate, return_dict_in_generate=True
    )
    unpatched = build_tiny_llama().generate(**inputs, **kwargs)
    enabled = enabled_llama.generate(**inputs, **kwargs)
    assert torch.equal(enabled.sequences, unpatched.sequences)
    assert enabled.spec_metrics["num_drafts"] == unpatched.spec_metrics["num_drafts"] > 0


@pytest.mark.parametrize("custom", ("callable", "hub_repo"))
def test_anyone_elses_custom_generate_is_refused(enabled_llama, custom):
    def my_loop(model, input_ids, **kwargs):  # pragma: no cover - must never run
        raise AssertionError("ran")

    value = my_loop if custom == "callable" else "someone/custom-loop"
    with pytest.raises(
        ValueError, match="only custom_generate allowed with it is hf_specdec.generate"
    ) as info:
        enabled_llama.generate(
            **repeated_span_batch(1),
            max_new_tokens=5,
            custom_generate=value,
            speculative_config=ngram_config(),
        )
    assert ("my_loop" if custom == "callable" else "someone/custom-loop") in str(info.value)  # what was given


def test_other_custom_generate_without_speculative_config_is_left_alone(enabled_llama):
    """Without speculative_config the enabled model is transformers' generate: any callable runs."""
    seen = []

    def my_loop(model, input_ids, **kwargs):
        seen.append(input_ids.shape)
        return torch.full((input_ids.shape[0], 1), PAD_TOKEN_ID)

    out = enabled_llama.generate(**repeated_span_batch(2), max_new_tokens=5, custom_generate=my_loop)
    assert seen and out.shape == (2, 1)


def test_a_generate_that_never_reaches_our_loop_is_an_error(tiny_llama):
    """A model whose generate() is its own (Diffusion Gemma's block diffusion) swallows custom_generate:
    speculative_config would be silently ignored. A model with no generate() at all is refused up front."""
    with pytest.raises(ValueError, match=r"enable\(\): LlamaModel has no generate\(\)"):
        hf_specdec.enable(tiny_llama.model)

    class OwnGenerate(type(tiny_llama)):
        def generate(self, input_ids, max_new_tokens=8, **ignored):
            return torch.cat([input_ids, input_ids.new_ones((input_ids.shape[0], max_new_tokens))], dim=1)

    model = hf_specdec.enable(OwnGenerate(tiny_llama.config).eval())
    with pytest.raises(ValueError, match=r"OwnGenerate.generate\(\) does not hand speculative_config to hf_specdec"):
        model.generate(input_ids=torch.tensor([[2, 5, 6]]), max_new_tokens=4, speculative_config={"method": "ngram"})
