"""Architectures beyond Llama: sliding windows, soft-capping, sinks, MoE, MLA, and the refusals.

Every test compares against the same model's plain `generate()` (greedy: token-identical), or
checks that a model the paged path cannot run exactly is refused before any work, with a
ValueError naming its model type and the reason.
"""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_TOKEN_ID, PAD_TOKEN_ID, left_padded_batch, plain_generate, repeated_span_prompts
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

import hf_specdec
from hf_specdec.cache.architectures import UnsupportedModelError, check_architecture

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=PAD_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    bos_token_id=2,
)


def tiny_mistral(sliding_window: int | None = 24, num_hidden_layers: int = 2) -> MistralForCausalLM:
    torch.manual_seed(0)
    config = MistralConfig(**TINY, num_hidden_layers=num_hidden_layers, sliding_window=sliding_window, initializer_range=0.1)
    return MistralForCausalLM(config).eval()


def long_prompts(batch_size: int, lengths: tuple[int, ...] = (31, 40, 52), seed: int = 3) -> list[list[int]]:
    """Prompts longer than the test windows, ending in repeated spans so n-gram drafts get accepted."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for length, tail in zip(lengths, repeated_span_prompts(batch_size, seed=seed)):
        head = torch.randint(3, 127, (max(length - len(tail), 0),), generator=generator).tolist()
        prompts.append(head + tail)
    return prompts


def speculate(target, inputs, max_new_tokens: int, **config):
    spec = {"method": "ngram", "num_speculative_tokens": 4, **config}
    return target.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        custom_generate=hf_specdec.generate,
        speculative_config=spec,
        return_dict_in_generate=True,
    )


def assert_identical_with_drafts(model, inputs, max_new_tokens: int = 40, **config):
    plain = plain_generate(model, **inputs, max_new_tokens=max_new_tokens, do_sample=False)
    out = speculate(model, inputs, max_new_tokens, **config)
    assert torch.equal(out.sequences, plain), "speculative output differs from plain generate()"
    assert out.spec_metrics["num_accepted_tokens"] > 0, "no draft was accepted: the test proves nothing"
    return out


# --- sliding windows ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", (1, 4, 8))
def test_mistral_sliding_window_matches_plain(k):
    """The reported bug: a Mistral whose sliding_window (24) is shorter than the context diverged a few
    tokens past the window; prompts of 31 to 52 tokens, batch 3, n-gram drafts."""
    model = tiny_mistral(sliding_window=24)
    inputs = left_padded_batch(long_prompts(3))
    assert inputs["input_ids"].shape[1] > 24
    assert_identical_with_drafts(model, inputs, max_new_tokens=40, num_speculative_tokens=k)


def test_sliding_window_is_applied_not_ignored():
    """With a window the output really differs from the same weights without one: the test above
    exercises the window, it does not pass by coincidence."""
    inputs = left_padded_batch(long_prompts(3))
    windowed = tiny_mistral(sliding_window=24)
    full = tiny_mistral(sliding_window=None)
    assert not torch.equal(
        speculate(windowed, inputs, 30).sequences, speculate(full, inputs, 30).sequences
    )


def test_long_generation_far_past_the_window():
    """Six windows' worth of new tokens (window 16), batch 2, one layer: identical throughout."""
    model = tiny_mistral(sliding_window=16, num_hidden_layers=1)
    inputs = left_padded_batch(long_prompts(2, lengths=(20, 33)))
    assert_identical_with_drafts(model, inputs, max_new_tokens=100)


def gemma2(**overrides) -> Gemma2ForCausalLM:
    """Alternating sliding (window 8) and full layers, attention and final logit soft-capping on."""
    torch.manual_seed(0)
    config = Gemma2Config(
        **{
            **TINY,
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 10.0,
            "initializer_range": 0.3,
            "tie_word_embeddings": False,  # tied, the random embeddings dominate: one token repeats
            **overrides,
        }
    )
    return Gemma2ForCausalLM(config).eval()


def test_gemma2_softcap_and_alternating_windows_match_plain():
    model = gemma2()
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    inputs = left_padded_batch(long_prompts(3))
    out = assert_identical_with_drafts(model, inputs)
    # the window and the soft-cap both change this model's output: the match above depends on both
    for changed in (gemma2(sliding_window=512), gemma2(attn_logit_softcapping=None)):
        assert not torch.equal(plain_generate(changed, **inputs, max_new_tokens=40, do_sample=False), out.sequences)


def gpt_oss(sink_scale: float = 2.0) -> GptOssForCausalLM:
    """Sliding (window 8) and full layers, 4 experts (2 per token), attention sinks of the given spread."""
    torch.manual_seed(0)
    config = GptOssConfig(
        **{**TINY, "num_hidden_layers": 2, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
        initializer_range=0.1,
    )
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():  # sinks start at zero: make them matter
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-sink_scale, sink_scale, layer.self_attn.sinks.numel()))
    return model


def test_gpt_oss_sinks_and_experts_match_plain():
    inputs = left_padded_batch(long_prompts(3))
    out = assert_identical_with_drafts(gpt_oss(), inputs)
    without_sinks = plain_generate(gpt_oss(sink_scale=0.0), **inputs, max_new_tokens=40, do_sample=False)
    assert not torch.equal(without_sinks, out.sequences), "the sinks do not change this model's output"


# --- refusals --------------------------------------------------------------------------------------


def test_attention_outside_the_interface_is_refused():
    """XGLM writes its cache through transformers' Cache but computes attention itself: the probe counts
    the cache writes and the paged attention calls and refuses it."""
    from transformers import XGLMConfig, XGLMForCausalLM

    torch.manual_seed(0)
    config = XGLMConfig(vocab_size=128, d_model=64, ffn_dim=128, num_layers=2, attention_heads=4, max_position_embeddings=64)
    model = XGLMForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match=r"model_type='xglm'.*not all routed through transformers' AttentionInterface"):
        check_architecture(model)


def test_unknown_attention_keyword_is_refused(monkeypatch):
    """An attention layer handing its attention function a keyword the paged path does not know."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, num_hidden_layers=2)).eval()
    attention_forward = type(model.model.layers[0].self_attn).forward

    def forward_with_extra(self, *args, **kwargs):
        return attention_forward(self, *args, experimental_bias=torch.zeros(1), **kwargs)

    monkeypatch.setattr(type(model.model.layers[0].self_attn), "forward", forward_with_extra)
    with pytest.raises(UnsupportedModelError, match=r"experimental_bias"):
        check_architecture(model)


def test_attention_the_paged_path_would_get_wrong_is_refused(monkeypatch):
    """A model whose attention output depends on something besides the cache (here: an extra mask the
    model's own attention function applies) fails the probe's logits comparison."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, num_hidden_layers=2)).eval()
    rotary = model.model.rotary_emb
    original = type(rotary).forward

    def shifted(self, x, position_ids):
        # positions counted from the cache length, not the given position_ids: wrong for packed rows
        return original(self, x, position_ids * 0 + torch.arange(position_ids.shape[-1]))

    monkeypatch.setattr(type(rotary), "forward", shifted)
    with pytest.raises(UnsupportedModelError, match=r"logits on the paged cache differ"):
        check_architecture(model)


def test_refusal_comes_before_any_work(monkeypatch):
    """generate() raises the ValueError before the loop allocates its cache or drafts."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hf_specdec.cache import paged_cache

    torch.manual_seed(0)
    config = Qwen2Config(**{**TINY, "num_hidden_layers": 2, "layer_types": ["full_attention", "indexed_attention"]})
    model = Qwen2ForCausalLM(config).eval()  # a layer kind (sparse indexed attention) the paged cache does not hold
    built = []
    monkeypatch.setattr(paged_cache.PagedKVCache, "for_model", classmethod(lambda cls, *a, **k: built.append(1)))
    inputs = left_padded_batch(long_prompts(2, lengths=(10, 12)))
    with pytest.raises(ValueError, match=r"model_type='qwen2' is not supported: layer 1 is 'indexed_attention'"):
        speculate(model, inputs, 5)
    assert not built
