"""Architectures beyond Llama: sliding windows, soft-capping, sinks, MoE, MLA, and the refusals.

Every test compares against the same model's plain `generate()` (greedy: token-identical), or
checks that a model the paged path cannot run exactly is refused before any work, with a
ValueError naming its model type and the reason.
"""

from __future__ import annotations

import copy

import numpy as np
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
from hf_specdec.cache.own_attention import runs_own_attention

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


def perturbed_copy(model: torch.nn.Module, scale: float = 0.01) -> torch.nn.Module:
    """The target with every weight moved by a little noise: a draft model that mostly agrees with it."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in draft.parameters():
            # a weight the model does not train stays (RoFormer's sinusoidal table: noise there breaks the
            # relative positions that make its padded rows read as the rows alone)
            if parameter.is_floating_point() and parameter.numel() > 1 and parameter.requires_grad:
                noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
                parameter.add_(noise * scale * parameter.std().clamp_min(1e-3))
    return draft


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


def test_attention_outside_the_interface_runs_on_its_own():
    """BLOOM writes its cache through transformers' Cache but computes attention (with ALiBi) itself: the
    paged probe counts the cache writes and the paged attention calls and finds them apart, so the model
    runs on its own attention and cache instead (`test_own_attention.py`)."""
    from transformers import BloomConfig, BloomForCausalLM

    from hf_specdec.cache import architectures

    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4)).eval()
    assert "not all routed through transformers' AttentionInterface" in architectures._probe(model)
    check_architecture(model)
    assert runs_own_attention(model)


def test_unknown_attention_keyword_sends_the_model_to_its_own_attention(monkeypatch):
    """An attention layer handing its attention function a keyword the paged path does not know: the
    paged probe names it, and the model runs on its own attention, which gets the keyword."""
    from hf_specdec.cache import architectures

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, num_hidden_layers=2)).eval()
    attention_forward = type(model.model.layers[0].self_attn).forward

    def forward_with_extra(self, *args, **kwargs):
        return attention_forward(self, *args, experimental_bias=torch.zeros(1), **kwargs)

    monkeypatch.setattr(type(model.model.layers[0].self_attn), "forward", forward_with_extra)
    assert "experimental_bias" in architectures._probe(model)
    check_architecture(model)
    assert runs_own_attention(model)


def _verdict(model) -> str:
    from hf_specdec.cache.architectures import padded_batch_problem

    try:
        check_architecture(model)
    except UnsupportedModelError as error:
        return f"refused: {str(error).split(': ', 2)[-1][:40]}"
    return ("own attention" if runs_own_attention(model) else "paged") + (", no padded batches" if padded_batch_problem(model) else "")


@pytest.mark.parametrize("model_type", ["bart", "diffllama", "kosmos-2.5", "cpmant", "zamba", "llama"])
def test_half_precision_gets_the_float32_verdict(model_type):
    """The probes decide by the model's code, not its precision: a bfloat16 model is probed on float32 copies of
    its weights, then has its own back. Before, rounding hid what the logits checks find in float32: bfloat16
    BART's decoder, DiffLlama and Kosmos-2.5 went to the paged path (wrong positions / masks), CPM-Ant and Zamba
    were accepted."""
    import families

    expected = _verdict(families.build_tiny_model(model_type))
    model = families.build_tiny_model(model_type).to(torch.bfloat16)
    weights = model.state_dict()
    assert _verdict(model) == expected
    after = model.state_dict()
    assert all(after[name].dtype == torch.bfloat16 and after[name].data_ptr() == weights[name].data_ptr() for name in weights)


def test_half_precision_model_too_large_to_check_is_refused(monkeypatch):
    """Where the float32 copies fit neither beside the weights nor in CPU memory, the model is refused saying so
    (not run unchecked)."""
    from hf_specdec.cache import architectures

    monkeypatch.setattr(architectures, "_free_memory", lambda device: 1024)
    model = LlamaForCausalLM(LlamaConfig(**TINY, num_hidden_layers=2)).eval().to(torch.bfloat16)
    with pytest.raises(UnsupportedModelError, match=r"could not be checked: the probes run torch.bfloat16 weights as float32"):
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
    config = Qwen2Config(**{**TINY, "num_hidden_layers": 2, "layer_types": ["full_attention", "minimax_m3_sparse"]})
    model = Qwen2ForCausalLM(config).eval()  # a layer kind the paged cache does not hold
    built = []
    monkeypatch.setattr(paged_cache.PagedKVCache, "for_model", classmethod(lambda cls, *a, **k: built.append(1)))
    inputs = left_padded_batch(long_prompts(2, lengths=(10, 12)))
    with pytest.raises(ValueError, match=r"model_type='qwen2' is not supported: layer 1 is 'minimax_m3_sparse'"):
        speculate(model, inputs, 5)
    assert not built


# --- every drafter on non-Llama families -------------------------------------------------------------

# sliding window + soft-cap, parallel attention / MLP with partial rotary, MoE with QK norms, learned
# positions, layers reusing earlier layers' KV (Gemma 3n; layer_skip keeps one of them)
DRAFTER_FAMILIES = ("gemma2", "gpt_neox", "qwen3_moe", "gpt2", "gemma3n_text", "gemma4_text")


def smaller_sibling(model_type: str):
    """A one-layer model of the same family and vocabulary (another seed): a draft model for it."""
    import families

    config = families.tiny_config(model_type)
    text = config.get_text_config()
    text.num_hidden_layers = 1
    for name in ("layer_types", "mlp_layer_types"):
        if getattr(text, name, None) is not None:
            setattr(text, name, list(getattr(text, name))[:1])
    if getattr(text, "num_kv_shared_layers", 0):
        text.num_kv_shared_layers = 0
    torch.manual_seed(1)
    return type(families.build_tiny_model(model_type))(config).eval()


def family_inputs():
    return left_padded_batch(long_prompts(3))


@pytest.mark.parametrize("model_type", DRAFTER_FAMILIES)
def test_model_drafters_on_other_families(model_type):
    """draft_model (a smaller sibling), layer_skip and EAGLE-3 (an untrained head bound to the target):
    identical to plain generate(), every drafter proposing drafts."""
    import families

    model = families.build_tiny_model(model_type)
    inputs = family_inputs()
    plain = plain_generate(model, **inputs, max_new_tokens=24, do_sample=False)
    configs = {
        "draft_model": {"method": "draft_model", "model": smaller_sibling(model_type)},
        "layer_skip": {"method": "layer_skip", "early_exit_layer": model.config.get_text_config().num_hidden_layers - 1},
        "eagle3": {"method": "eagle3", "model": hf_specdec.EagleHead.for_target(model, "eagle3", seed=0)},
    }
    for name, config in configs.items():
        out = speculate(model, inputs, 24, num_speculative_tokens=3, **config)
        assert torch.equal(out.sequences, plain), f"{name} on {model_type} differs from plain generate()"
        assert out.spec_metrics["num_draft_tokens"] > 0, f"{name} on {model_type} never drafted"


def mtp_families() -> list[str]:
    """Causal-LM families whose config declares multi-token-prediction layers (num_mtp_layers)."""
    import dataclasses

    import families

    found = []
    for model_type in families.causal_lm_families():
        cls = families.config_class(model_type)
        names = set(getattr(cls, "attribute_map", {})) | {f.name for f in dataclasses.fields(cls)}
        if "num_mtp_layers" in names and model_type not in families.FAMILY_NOTES:
            found.append(model_type)
    return found


@pytest.mark.parametrize("model_type", mtp_families())
def test_mtp_on_every_family_with_mtp_layers(model_type):
    """transformers' MtpModel built for the target (random MTP layer), batched, k=3 beyond the one layer."""
    import families
    from transformers.modeling_layers import MtpModel

    model = families.build_tiny_model(model_type)
    try:
        check_architecture(model)
    except UnsupportedModelError:  # a hybrid family: refused for its target layers, MTP or not
        with pytest.raises(ValueError, match=f"model_type='{model_type}' is not supported"):
            speculate(model, family_inputs(), 8, method="mtp")
        return
    text = model.config.get_text_config()
    text.num_mtp_layers = 1
    for name, main in (("mtp_layer_types", "layer_types"), ("mtp_mlp_layer_types", "mlp_layer_types")):
        if getattr(text, main, None) is not None and getattr(text, name, None) is None:
            setattr(text, name, [getattr(text, main)[-1]])
    try:
        mtp = MtpModel(model, 1).eval()
    except Exception as error:  # a family whose MTP layers transformers cannot build refuses at our door too
        with pytest.raises(ValueError):
            speculate(model, family_inputs(), 8, method="mtp")
        pytest.fail(f"transformers cannot build MTP layers for {model_type}: {error}")
    with torch.no_grad():
        for name, parameter in mtp.layers.named_parameters():
            parameter.fill_(1.0) if "norm" in name else parameter.normal_(0.0, 0.05)
    inputs = family_inputs()
    if runs_own_attention(model):  # its layers, and so its MTP layers, need their own attention
        with pytest.raises(ValueError, match="method='mtp' is not supported for this model: it runs on its own attention"):
            speculate(model, inputs, 20, method="mtp", model=mtp, num_speculative_tokens=3)
        return
    plain = plain_generate(model, **inputs, max_new_tokens=20, do_sample=False)
    out = speculate(model, inputs, 20, method="mtp", model=mtp, num_speculative_tokens=3)
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_draft_tokens"] > 0


# --- hybrid models: recurrent / convolution state rolled back per row --------------------------------

HYBRID_FAMILIES = ("qwen3_next", "mamba2", "lfm2", "jamba")


@pytest.mark.parametrize("model_type", HYBRID_FAMILIES)
def test_hybrid_models_roll_their_state_back_exactly(model_type):
    """Gated delta-net (Qwen3-Next), Mamba-2, short convolutions (LFM2), Mamba + attention + MoE (Jamba):
    batch 3, drafts partly rejected at every depth (a perturbed-copy draft model, k=5), identical."""
    import families
    model = families.build_tiny_model(model_type)
    inputs = family_inputs()
    plain = plain_generate(model, **inputs, max_new_tokens=40, do_sample=False)
    out = speculate(model, inputs, 40, method="draft_model", model=perturbed_copy(model, scale=0.05), num_speculative_tokens=5)
    assert torch.equal(out.sequences, plain)
    per_position = out.spec_metrics["num_accepted_tokens_per_pos"]
    drafted = out.spec_metrics["num_draft_tokens"]
    assert 0 < out.spec_metrics["num_accepted_tokens"] < drafted, "no partial rollback happened"
    assert len(per_position) >= 2
    # an EAGLE-3 head reads the target's hidden states, captured over the per-row forwards
    head = hf_specdec.EagleHead.for_target(model, "eagle3", seed=0)
    out = speculate(model, inputs, 40, method="eagle3", model=head, num_speculative_tokens=3)
    assert torch.equal(out.sequences, plain) and out.spec_metrics["num_draft_tokens"] > 0


def test_recurrent_rollback_equals_never_having_fed_the_tokens():
    """Feed 9 tokens, roll back to 6: the row's conv and recurrent states equal those after feeding 6."""
    import families

    from hf_specdec.cache.forward import forward_tokens
    from hf_specdec.cache.paged_attention import use_paged_attention
    from hf_specdec.cache.paged_cache import PagedKVCache

    model = families.build_tiny_model("qwen3_next")
    tokens = torch.arange(10, 19)

    def states_after(fed: int, rollback_to: int | None = None):
        cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4, max_rollback=4)
        with torch.no_grad(), use_paged_attention(model):
            forward_tokens(model, cache, [0], [fed], tokens[:fed], torch.arange(fed), np.arange(1))
        if rollback_to is not None:
            cache.rollback(0, rollback_to)
        layers = cache.recurrent.layers_of(0)
        return {i: (layer.conv_states[0].clone(), layer.recurrent_states[0].clone()) for i, layer in layers.items()}

    rolled, fresh = states_after(9, rollback_to=6), states_after(6, rollback_to=6)  # a rollback also trims the window
    assert rolled.keys() == fresh.keys() and rolled
    for index in rolled:
        torch.testing.assert_close(rolled[index][0], fresh[index][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(rolled[index][1], fresh[index][1], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="the states of the last 4 are kept"):
        cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4, max_rollback=4)
        with torch.no_grad(), use_paged_attention(model):
            forward_tokens(model, cache, [0], [9], tokens, torch.arange(9), np.arange(1))
        cache.rollback(0, 3)  # 6 tokens back: more than were recorded


@pytest.mark.parametrize("model_type", [*HYBRID_FAMILIES, "zamba2"])
def test_layer_skip_on_hybrid_models(model_type):
    """layer_skip advances the early layers' recurrent state as it drafts and crops it back: identical,
    drafts accepted and rejected (the first step, the whole prompt pending, drafts nothing), at k=5
    and at k=1 (the rollback record then holds one token: the pending one). Zamba 2: layers whose
    one cache layer holds recurrent state and attention."""
    import families

    model = families.build_tiny_model(model_type)
    inputs = family_inputs()
    plain = plain_generate(model, **inputs, max_new_tokens=30, do_sample=False)
    layers = model.config.get_text_config().num_hidden_layers
    for k in (5, 1):
        out = speculate(model, inputs, 30, method="layer_skip", early_exit_layer=layers - 1, num_speculative_tokens=k)
        accepted, drafted = out.spec_metrics["num_accepted_tokens"], out.spec_metrics["num_draft_tokens"]
        assert torch.equal(out.sequences, plain) and 0 < accepted < drafted, (k, accepted, drafted)


def sparse_attention_model(model_type: str):
    """A tiny DeepSeek-V3.2, or a Mistral Large 4 whose layer 1 reuses layer 0's latents but runs an
    indexer of its own ("reuse_but_indexer")."""
    import families

    config = families.tiny_config(model_type)
    if model_type == "mistral_large4":
        text = config.get_text_config()
        text.kv_source_layers, text.indexer_types = [0, 0, 2, 3], ["full"] * 4
        assert text.kv_sharing_modes[:2] == ["store", "reuse_but_indexer"]
    return families.build_tiny_model(model_type, config=config)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "mistral_large4"])
def test_sparse_indexed_attention_honours_the_indexers_selection(model_type, monkeypatch):
    """Sparse attention (each query sees the top 16 of up to 70 keys its indexer scores): each row
    equals plain generate(), drafts accepted and rejected, as chains and as trees; attending to every key
    instead changes the output, so the selection is honoured, not bypassed."""
    from hf_specdec.cache import paged_attention

    model = sparse_attention_model(model_type)
    inputs = left_padded_batch([p[-31:] for p in long_prompts(2)])  # 31 tokens each: past index_topk
    plain = plain_generate(model, **inputs, max_new_tokens=30, do_sample=False)
    for tree in (None, {"num_nodes": 8, "topk": 2}):  # a draft tree: each row's forward with its own tree mask
        out = speculate(model, inputs, 30, method="draft_model", model=perturbed_copy(model), num_speculative_tokens=3,
                        tree=tree)  # fmt: skip
        assert torch.equal(out.sequences, plain), tree
        assert 0 < out.spec_metrics["num_accepted_tokens"] < out.spec_metrics["num_draft_tokens"]
    monkeypatch.setattr(paged_attention, "_with_indices", lambda mask, indices, meta: mask)
    every_key = speculate(model, inputs, 30, method="ngram", num_speculative_tokens=3)
    assert not torch.equal(every_key.sequences, plain)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "mistral_large4"])
def test_sparse_indexed_attention_takes_left_padded_batches_within_index_topk(model_type):
    """Past index_topk tokens plain generate() ranks a padded row's keys otherwise than the row alone's
    (tiny Mistral Large 4, Hy-V4-VL), and the loop runs rows unpadded: a left-padded batch that may grow
    past 16 tokens is refused naming attention_mask; one within 16 runs, equal to plain generate()."""
    model = sparse_attention_model(model_type)
    prompts = long_prompts(2)
    with pytest.raises(ValueError, match=r"attention_mask: .* index_topk=16 .* past 16 tokens"):
        speculate(model, left_padded_batch(prompts), 30, method="ngram", num_speculative_tokens=3)
    short = left_padded_batch([prompts[0][:5], prompts[1][:9]])  # 9 wide + 7 new = 16 tokens
    plain = plain_generate(model, **short, max_new_tokens=7, do_sample=False)
    out = speculate(model, short, 7, method="draft_model", model=perturbed_copy(model), num_speculative_tokens=3)
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_accepted_tokens"] > 0


@pytest.mark.parametrize(("model_type", "held"), [("qwen3_next", "a hybrid model's recurrent state"),
                                                   ("deepseek_v32", "a sparse indexer's keys")])  # fmt: skip
def test_model_prefill_refused_where_its_cache_cannot_be_handed_over(model_type, held):
    """Image (or other non-text) inputs make the model prefill its own cache, which the loop then copies
    key by key: refused, with the reason, for caches holding more than keys and values; and such a model
    whose prompt attends both ways is refused whole."""
    import families

    from hf_specdec.cache.prefill import check_model_prefill

    with pytest.raises(ValueError, match=rf"model inputs \['pixel_values'\] are not supported .* handing {held}"):
        check_model_prefill(families.build_tiny_model(model_type), {"pixel_values": torch.zeros(1, 3, 8, 8)})
    # a prompt that attends both ways needs that prefill for every prompt: such a model is refused as a whole
    config = families.tiny_config(model_type)
    config.get_text_config().use_bidirectional_attention = True
    with pytest.raises(ValueError, match=rf"its prompt attends both ways \(use_bidirectional_attention\), and handing {held}"):
        check_architecture(families.build_tiny_model(model_type, config=config))


# --- image-text-to-text: the model's own forward prefills, the loop speculates on the text ------------


def tiny_gemma3_vlm():
    """Gemma 3 with a one-layer SigLIP tower (32 px images, 4 tokens each), sliding window 8 < the prompts."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(TINY, vocab_size=300, num_hidden_layers=2, sliding_window=8, initializer_range=0.2, tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299, boi_token_index=297,
        eoi_token_index=298, initializer_range=0.2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    # transformers starts the projector at zeros: every image would give the same (zero) features
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.2)
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


def image_prompts():
    """Two left-padded rows, each with one image (its 4 tokens between begin / end markers) and text after
    it; token_type_ids mark the image tokens, so image tokens see each other as Gemma 3's processor asks."""
    image = [297, 299, 299, 299, 299, 298]
    rows = [[2, 5, 6, *image, 7, 8, 9, 10, 11, 7, 8, 9], [2, *image, 20, 21, 22, 23, 20, 21]]
    inputs = left_padded_batch(rows)
    inputs["token_type_ids"] = (inputs["input_ids"] == 299).long()
    # two distinct images: noise alone looks alike to a random vision tower
    noise = 0.1 * torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    inputs["pixel_values"] = noise + torch.tensor([1.0, -1.0])[:, None, None, None]
    return inputs


@pytest.mark.parametrize("drafter", ["ngram", "eagle3"])
def test_image_prompt_prefilled_by_the_model_then_speculated(drafter):
    model = tiny_gemma3_vlm()
    inputs = image_prompts()
    plain = plain_generate(model, **inputs, max_new_tokens=24, do_sample=False)
    other_images = {**inputs, "pixel_values": inputs["pixel_values"].flip(0)}
    assert not torch.equal(plain, plain_generate(model, **other_images, max_new_tokens=24, do_sample=False)), (
        "the images do not change the output: the test would not notice them being dropped"
    )
    config = {"method": "ngram"} if drafter == "ngram" else {
        "method": "eagle3", "model": hf_specdec.EagleHead.for_target(model, "eagle3", seed=0)
    }
    out = speculate(model, inputs, 24, **config)
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_draft_tokens"] > 0


def test_positions_given_to_generate_are_honoured():
    """generate(position_ids=...) runs the prompt at the caller's positions and continues from the last one;
    they change the output (RoPE sees other distances). The model's own forward prefills such a prompt and the
    loop continues at each row's offset, with drafts accepted and rejected. Before, they were dropped: the
    tokens of the default positions. A model on its own attention, where that prefill is not handed over,
    refuses them, naming them."""
    import families

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(TINY, initializer_range=0.2), num_hidden_layers=2)).eval()
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    inputs = left_padded_batch(repeated_span_prompts(3, seed=4))
    spread = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0) * 3  # every third position, padding at 0
    plain = plain_generate(model, **inputs, position_ids=spread, max_new_tokens=16, do_sample=False)
    assert not torch.equal(plain, plain_generate(model, **inputs, max_new_tokens=16, do_sample=False))
    accepted = 0
    for config in ({"method": "ngram"}, {"method": "draft_model", "model": perturbed_copy(model), "num_speculative_tokens": 3}):
        out = speculate(model, {**inputs, "position_ids": spread}, 16, **config)
        assert torch.equal(out.sequences, plain), config["method"]
        accepted += out.spec_metrics["num_accepted_tokens"]
    assert accepted > 0
    own = families.build_tiny_model("gpt_neo")
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match=r"model inputs \['position_ids'\] are not supported for model_type='gpt_neo'"):
        speculate(own, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(4)[None] * 2}, 4)


def test_llava_image_prompts_with_draft_chains_and_trees():
    """Llava (a CLIP tower whose 17 features replace the image tokens, a Llama over them): a model
    transformers lists only as image-text-to-text. Draft trees work on it (no sliding window), in
    generate() and in the engine, which prefills the request's image with the model's own forward."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    config = LlavaConfig(
        text_config=LlamaConfig(**dict(TINY, vocab_size=300), num_hidden_layers=2), vision_config=vision,
        image_token_index=299,
        vision_feature_layer=-1, vision_feature_select_strategy="full",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    prompt = [2, 5, 6, *[299] * 17, 7, 8, 9, 10, 11, 7, 8, 9]
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) + 1
    inputs = {"input_ids": torch.tensor([prompt]), "pixel_values": image}
    plain = plain_generate(model, **inputs, max_new_tokens=20, do_sample=False)
    other = plain_generate(model, **{**inputs, "pixel_values": -image}, max_new_tokens=20, do_sample=False)
    assert not torch.equal(plain, other), "the image does not change the output"
    for tree in (None, {"num_nodes": 8, "topk": 2}):
        config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "tree": tree}
        out = speculate(model, {**inputs, "attention_mask": torch.ones(1, len(prompt), dtype=torch.long)}, 20, **config)
        assert torch.equal(out.sequences, plain) and out.spec_metrics["num_accepted_tokens"] > 0, tree
    engine = hf_specdec.SpeculativeEngine(model, config, max_batch_size=2)
    request_id = engine.add_request(prompt, {"max_new_tokens": 20, "do_sample": False}, model_inputs={"pixel_values": image})
    outputs = [output for _ in range(40) for output in engine.step()]
    assert outputs[-1].request_id == request_id and outputs[-1].finished
    assert outputs[-1].token_ids == plain[0, len(prompt) :].tolist() and engine.num_kv_blocks_used == 0


def tiny_paligemma(sliding_window: int | None) -> torch.nn.Module:
    """PaliGemma: a SigLIP tower whose 4 features replace the image tokens, then a Gemma whose prompt attends both
    ways (`use_bidirectional_attention`); with `sliding_window`, PaliGemma 2's Gemma 2 (a sliding layer, a full one)."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    text = dict(TINY, model_type="gemma", vocab_size=300, num_hidden_layers=2, initializer_range=0.2)
    if sliding_window is not None:
        text.update(model_type="gemma2", sliding_window=sliding_window)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=16, projection_dim=64)  # fmt: skip
    config = PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=299, projection_dim=64)
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_paligemma_prompt_attending_both_ways_is_prefilled_by_the_model(sliding_window):
    """PaliGemma's prompt (image tokens and prefix text; on PaliGemma 1 text alone too, unpadded: SDPA runs it
    with no mask) attends both ways in plain generate()'s first forward, and its positions count from 1: the
    model's own forward prefills every prompt, the loop feeds the last prompt token again and speculates from
    there. Greedy outputs and their logits are plain generate()'s with images (a left-padded batch) and without,
    in generate() and in the engine; on PaliGemma 2 a prompt longer than the sliding window is refused (plain
    generate() lets its last token read past the window there)."""
    model = tiny_paligemma(sliding_window)
    rows = [[*[299] * 4, 2, 5, 6, 7, 8, 9, 10, 11, 7, 8, 9, 10, 3], [*[299] * 4, 2, 20, 21, 22, 23, 20, 21, 3]]
    text = torch.tensor([rows[0][4:]])
    images = {**left_padded_batch(rows), "pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    images["token_type_ids"] = torch.zeros_like(images["input_ids"])  # the prefix, as PaliGemma's processor marks it
    with torch.no_grad():  # the prompt attends both ways: dropping its last token changes the logits before it
        whole = model(**{name: value[:1] for name, value in images.items()}).logits[0, :-1]
        cut = model(**{name: value[:1, :-1] if name != "pixel_values" else value[:1] for name, value in images.items()}).logits[0]
    assert (whole - cut).abs().max() > 0.1
    plain = plain_generate(model, **images, max_new_tokens=24, do_sample=False)
    other = plain_generate(model, **{**images, "pixel_values": images["pixel_values"].flip(0)}, max_new_tokens=24, do_sample=False)
    assert not torch.equal(plain, other), "the images do not change the output"
    for config in ({"method": "ngram"}, {"method": "draft_model", "model": perturbed_copy(model), "num_speculative_tokens": 3}):
        out = speculate(model, images, 24, **config)
        assert torch.equal(out.sequences, plain) and out.spec_metrics["num_accepted_tokens"] > 0, config["method"]
    # logits too: a prefill whose earlier keys missed the last prompt token moves them by ~0.5 with the same argmax
    options = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    plain_logits = torch.stack(model.generate(**images, **options).logits, dim=1)
    ours = model.generate(**images, **options, custom_generate=hf_specdec.generate, speculative_config={"method": "ngram"})
    assert (torch.stack(ours.logits, dim=1) - plain_logits).abs().max() < 1e-4
    alone = plain_generate(model, input_ids=text, attention_mask=torch.ones_like(text), max_new_tokens=24, do_sample=False)
    out = speculate(model, {"input_ids": text, "attention_mask": torch.ones_like(text)}, 24, method="ngram")
    assert torch.equal(out.sequences, alone)

    engine = hf_specdec.SpeculativeEngine(model, {"method": "ngram"}, max_batch_size=2)
    first = rows[1]
    image = images["pixel_values"][1:]
    expected = {
        engine.add_request(text[0].tolist(), {"max_new_tokens": 24, "do_sample": False}): alone[0, text.shape[1] :].tolist(),
        engine.add_request(first, {"max_new_tokens": 24, "do_sample": False}, model_inputs={
            "pixel_values": image, "token_type_ids": torch.zeros(1, len(first), dtype=torch.long)
        }): plain_generate(
            model, input_ids=torch.tensor([first]), pixel_values=image, token_type_ids=torch.zeros(1, len(first), dtype=torch.long),
            max_new_tokens=24, do_sample=False,
        )[0, len(first) :].tolist(),
    }  # fmt: skip
    finished = {out.request_id: out.token_ids for _ in range(60) for out in engine.step() if out.finished}
    assert finished == expected and engine.num_kv_blocks_used == 0

    if sliding_window is None:
        return
    long_prompt = list(range(5, 30))  # 25 tokens, window 24
    with pytest.raises(ValueError, match=r"input_ids: the prompt \(25 tokens\) is longer than the sliding window \(24 tokens\)"):
        speculate(model, {"input_ids": torch.tensor([long_prompt])}, 4, method="ngram")
    with pytest.raises(ValueError, match=r"prompt_ids: the prompt \(25 tokens\) is longer than the sliding window"):
        engine.add_request(long_prompt, {"max_new_tokens": 4})


def tiny_mrope_vlm(model_type: str, initializer_range: float = 0.02):
    """Qwen2.5-VL or Qwen3-VL (M-RoPE: an image's tokens sit on a 3-D grid) with a one-layer vision
    tower: 4-px patches, merged 2x2, so an image of 4x4 / 4x8 patches gives 4 / 8 tokens."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    if model_type == "qwen3_vl":
        rope = {**rope, "mrope_interleaved": True}
        vision = {**vision, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}
    else:
        vision = {**vision, "window_size": 8, "fullatt_block_indexes": [0]}
    config = AutoConfig.for_model(
        model_type, text_config=dict(TINY, vocab_size=300, num_hidden_layers=2, rope_parameters=rope, initializer_range=initializer_range),
        vision_config=vision, image_token_id=299, vision_start_token_id=297, vision_end_token_id=298, video_token_id=296,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


def mrope_image_prompts() -> tuple[list[list[int]], list[dict]]:
    """Two prompts with an image each (4 and 8 tokens: the text after them sits 2 and 4 positions
    before its token count), and each prompt's inputs as its processor gives them."""
    grids = [torch.tensor([[1, 4, 4]]), torch.tensor([[1, 4, 8]])]
    prompts = [[2, 5, 6, 297, *[299] * 4, 298, 7, 8, 9, 10, 11, 7, 8, 9], [2, 297, *[299] * 8, 298, 20, 21, 22, 23, 20, 21]]
    generator = torch.Generator().manual_seed(0)
    inputs = [{
        "pixel_values": torch.randn(int(grid.prod()), 3 * 2 * 4 * 4, generator=generator) + sign,
        "image_grid_thw": grid,
        "mm_token_type_ids": (torch.tensor([prompt]) == 299).int(),
    } for prompt, grid, sign in zip(prompts, grids, (1, -1))]  # fmt: skip
    return prompts, inputs


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_image_prompts_continue_at_the_models_positions(model_type, monkeypatch):
    """After an image, M-RoPE models place text at its token count plus a per-row offset (here -2 and
    -4); the loop feeds those positions, in generate() (a left-padded batch) and in the engine."""
    import hf_specdec.cache.prefill as prefill

    model = tiny_mrope_vlm(model_type)
    prompts, inputs = mrope_image_prompts()
    batch = left_padded_batch(prompts)
    batch["mm_token_type_ids"] = (batch["input_ids"] == 299).int()
    batch["pixel_values"] = torch.cat([i["pixel_values"] for i in inputs])
    batch["image_grid_thw"] = torch.cat([i["image_grid_thw"] for i in inputs])
    plain = plain_generate(model, **batch, max_new_tokens=24, do_sample=False)
    width = batch["input_ids"].shape[1]
    for config in ({"method": "ngram"}, {"method": "layer_skip", "early_exit_layer": 1}):
        out = speculate(model, batch, 24, **config)
        assert torch.equal(out.sequences, plain) and out.spec_metrics["num_accepted_tokens"] > 0, config
    engine = hf_specdec.SpeculativeEngine(model, {"method": "ngram", "num_speculative_tokens": 4}, max_batch_size=2)
    ids = [engine.add_request(p, {"max_new_tokens": 24, "do_sample": False}, model_inputs=i) for p, i in zip(prompts, inputs)]
    finished = {o.request_id: o.token_ids for _ in range(60) for o in engine.step() if o.finished}
    assert [finished[i] for i in ids] == plain[:, width:].tolist() and engine.num_kv_blocks_used == 0
    # the offsets matter: at token-count positions the text after the images reads differently
    monkeypatch.setattr(prefill, "_position_offsets", lambda model, positions, lens: np.zeros_like(lens))
    assert not torch.equal(speculate(model, batch, 24).sequences, plain)


def test_layer_skip_drafts_at_the_models_positions_after_an_mrope_image():
    """With its second layer made an identity, the model's first layer drafts exactly what the whole
    model says, so every draft passes: only if layer_skip feeds the offset positions too."""
    model = tiny_mrope_vlm("qwen2_5_vl", initializer_range=0.2)  # sharp attention: positions matter
    skipped = model.model.language_model.layers[1]
    with torch.no_grad():
        skipped.self_attn.o_proj.weight.zero_()
        skipped.mlp.down_proj.weight.zero_()
    prompts, inputs = mrope_image_prompts()
    batch = {**left_padded_batch(prompts), "pixel_values": torch.cat([i["pixel_values"] for i in inputs]),
             "image_grid_thw": torch.cat([i["image_grid_thw"] for i in inputs])}  # fmt: skip
    batch["mm_token_type_ids"] = (batch["input_ids"] == 299).int()
    metrics = speculate(model, batch, 40, method="layer_skip", early_exit_layer=1).spec_metrics
    assert metrics["num_draft_tokens"] > 30 and metrics["num_accepted_tokens"] == metrics["num_draft_tokens"]


def test_mrope_prompt_ending_with_an_image_refused():
    """The token after an image would sit at a different position on each M-RoPE axis: generate() and
    the engine's add_request refuse it, as the engine does inputs whose image grids do not fit the prompt."""
    model = tiny_mrope_vlm("qwen2_5_vl")
    prompts, inputs = mrope_image_prompts()
    ending_with_image = {"input_ids": torch.tensor([prompts[0][:8]]), **inputs[0]}
    ending_with_image["mm_token_type_ids"] = ending_with_image["mm_token_type_ids"][:, :8]
    with pytest.raises(ValueError, match=r"model_type='qwen2_5_vl(_text)?': the prompt ends with an image or video token"):
        speculate(model, ending_with_image, 8)
    engine = hf_specdec.SpeculativeEngine(model, {"method": "ngram"}, max_batch_size=2)  # refused as it is added
    model_inputs = {k: v for k, v in ending_with_image.items() if k != "input_ids"}
    with pytest.raises(ValueError, match="the prompt ends with an image or video token"):
        engine.add_request(prompts[0][:8], model_inputs=model_inputs)
    with pytest.raises(ValueError, match="model_inputs do not fit the prompt"):  # 8 image tokens, a 4-token grid
        engine.add_request(prompts[1], model_inputs={**model_inputs, "mm_token_type_ids": (torch.tensor([prompts[1]]) == 299).int()})
    assert engine.num_waiting == 0


def tiny_vlm_with_image(model_type: str) -> tuple[torch.nn.Module, dict]:
    """A tiny VLM of `model_type` (a one-layer vision tower on 32-px images, weights at std 0.2 so the
    image changes the reply) and one image's inputs as its processor lays them out. Each family turns
    the image's 4x4 patches into 4 tokens (id 299; GLM-4V and Llama 4 wrap them in 297 / 298)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = dict(TINY, vocab_size=300, num_hidden_layers=2, initializer_range=0.2)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) + 1
    if model_type == "idefics3":  # SmolVLM's architecture
        config = AutoConfig.for_model(model_type, text_config=dict(text, model_type="llama"), image_token_id=299,
                                      vision_config=dict(tower, image_size=32, patch_size=8), scale_factor=2)  # fmt: skip
        inputs = {"pixel_values": pixels[None], "pixel_attention_mask": torch.ones(1, 1, 32, 32, dtype=torch.bool)}
    elif model_type == "mistral3":  # Pixtral tower, patch merger
        config = AutoConfig.for_model(model_type, text_config=dict(text, model_type="mistral"), image_token_index=299,
                                      vision_config=dict(tower, image_size=32, patch_size=8, head_dim=16))  # fmt: skip
        inputs = {"pixel_values": pixels, "image_sizes": torch.tensor([[32, 32]])}
    elif model_type == "aya_vision":  # a SigLIP tower, pixel shuffle, a Cohere 2 with sliding windows
        config = AutoConfig.for_model(
            model_type, text_config=dict(text, model_type="cohere2", sliding_window=8,
                                         layer_types=["sliding_attention", "full_attention"]),
            vision_config=dict(tower, image_size=32, patch_size=8, model_type="siglip_vision_model"), image_token_id=299,
            downsample_factor=2, vision_feature_layer=-1,
        )  # fmt: skip
        inputs = {"pixel_values": pixels}
    elif model_type == "llama4":  # chunked attention (8) with a global NoPE layer; MoE
        text4 = dict(text, model_type="llama4_text", attention_chunk_size=8, no_rope_layers=[1, 0],
                     intermediate_size_mlp=128, num_local_experts=2, interleave_moe_layer_step=1)  # fmt: skip
        vision = dict(tower, intermediate_size=128, image_size=32, patch_size=8, vision_output_dim=32,
                      projector_input_dim=32, projector_output_dim=32, pixel_shuffle_ratio=0.5)  # fmt: skip
        config = AutoConfig.for_model(model_type, text_config=text4, vision_config=vision, image_token_index=299,
                                      boi_token_index=297, eoi_token_index=298)  # fmt: skip
        inputs = {"pixel_values": pixels}
    elif model_type == "gemma4":  # as Gemma 4 E2B / E4B: the last layers reuse earlier layers' KV
        import families

        text4 = dict(families.tiny_config("gemma4").text_config.to_dict(), vocab_size=300, vocab_size_per_layer_input=300,
                     initializer_range=0.05)  # fmt: skip  (at 0.2 its replies repeat one token, whatever the image)
        vision = dict(tower, num_key_value_heads=2, head_dim=16, patch_size=8, pooling_kernel_size=2,
                      position_embedding_size=16, initializer_range=0.2)
        config = AutoConfig.for_model(model_type, text_config=text4, vision_config=vision, image_token_id=299)
        grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), dim=-1)
        patches = pixels.unfold(2, 8, 8).unfold(3, 8, 8).permute(0, 2, 3, 1, 4, 5).reshape(1, 16, 192)
        inputs = {"pixel_values": patches, "image_position_ids": grid.reshape(1, 16, 2)}
    elif model_type == "internvl":  # pixel shuffle
        config = AutoConfig.for_model(model_type, text_config=dict(text, model_type="qwen2"), image_token_id=299,
                                      vision_config=dict(tower, image_size=[32, 32], patch_size=[8, 8]))  # fmt: skip
        inputs = {"pixel_values": pixels}
    else:  # glm4v: M-RoPE with GLM's own position index
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "partial_rotary_factor": 1.0}
        vision = dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, image_size=32)  # fmt: skip
        config = AutoConfig.for_model(model_type, text_config=dict(text, rope_parameters=rope), vision_config=vision,
                                      image_token_id=299, image_start_token_id=297, image_end_token_id=298,
                                      video_token_id=296)  # fmt: skip
        inputs = {"pixel_values": pixels.reshape(32, 96)[:16], "image_grid_thw": torch.tensor([[1, 4, 4]])}  # 16 patches
    config.initializer_range = 0.2
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model, inputs


@pytest.mark.parametrize("model_type", ["idefics3", "mistral3", "aya_vision", "llama4", "internvl", "glm4v", "gemma4"])
def test_image_prompts_across_vlm_families(model_type):
    """SmolVLM's Idefics 3, Mistral 3, Aya Vision, Llama 4, InternVL, GLM-4V and Gemma 4 (KV shared across
    layers): an image prompt in generate() (a draft model that sees the text only: drafts accepted and
    rejected) and in the engine equals plain generate()."""
    model, image_inputs = tiny_vlm_with_image(model_type)
    image = [297, *[299] * 4, 298] if model_type in ("glm4v", "llama4") else [299] * 4
    prompt = [2, 5, 6, *image, 7, 8, 9, 10, 11, 7, 8, 9]
    inputs = {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, len(prompt), dtype=torch.long)}
    if model_type == "glm4v":
        image_inputs["mm_token_type_ids"] = (inputs["input_ids"] == 299).int()
    plain = plain_generate(model, **inputs, **image_inputs, max_new_tokens=20, do_sample=False)
    other = {**image_inputs, "pixel_values": -3 * image_inputs["pixel_values"]}
    assert not torch.equal(plain, plain_generate(model, **inputs, **other, max_new_tokens=20, do_sample=False))
    out = speculate(model, {**inputs, **image_inputs}, 20, method="draft_model", model=perturbed_copy(model), num_speculative_tokens=3)
    accepted, drafted = out.spec_metrics["num_accepted_tokens"], out.spec_metrics["num_draft_tokens"]
    assert torch.equal(out.sequences, plain) and 0 < accepted < drafted
    engine = hf_specdec.SpeculativeEngine(model, {"method": "ngram", "prompt_lookup_min": 1}, max_batch_size=2)
    request_id = engine.add_request(prompt, {"max_new_tokens": 20, "do_sample": False}, model_inputs=image_inputs)
    finished = {o.request_id: o.token_ids for _ in range(40) for o in engine.step() if o.finished}
    assert finished[request_id] == plain[0, len(prompt) :].tolist() and engine.num_kv_blocks_used == 0


def test_vlm_draft_model_loaded_from_its_folder(tmp_path):
    """A draft that transformers lists only as image-text-to-text (a Mistral 3, like the target) loads
    from its folder as AutoModelForImageTextToText, as `serve` loads such a target."""
    model, image_inputs = tiny_vlm_with_image("mistral3")
    perturbed_copy(model).save_pretrained(tmp_path / "draft")
    prompt = [2, 5, 6, *[299] * 4, 7, 8, 9, 10, 11, 7, 8, 9]
    inputs = {"input_ids": torch.tensor([prompt]), **image_inputs}
    plain = plain_generate(model, **inputs, max_new_tokens=16, do_sample=False)
    out = speculate(model, inputs, 16, method="draft_model", model=str(tmp_path / "draft"), num_speculative_tokens=3)
    assert torch.equal(out.sequences, plain) and out.spec_metrics["num_accepted_tokens"] > 0


def test_hunyuan_vl_image_prompt_with_four_rope_axes():
    """HunyuanVL's M-RoPE has 4 axes and no row of text positions (sequence, width, height, image
    index); its image span (8 tokens: rows of pooled patches, row separators, two boundary tokens)
    leaves the text after it at its token count."""
    import families
    from transformers import AutoModelForImageTextToText

    config = families.tiny_config("hunyuan_vl")
    config.image_token_id, config.initializer_range, config.text_config.initializer_range = 120, 0.2, 0.2
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    prompt = [2, 5, 6, *[120] * 8, 7, 8, 9, 10, 11, 7, 8, 9]
    input_ids = torch.tensor([prompt])
    image = {"pixel_values": torch.randn(16, 768, generator=torch.Generator().manual_seed(0)) + 1,
             "image_grid_thw": torch.tensor([[1, 4, 4]]), "mm_token_type_ids": (input_ids == 120).int()}  # fmt: skip
    plain = plain_generate(model, input_ids=input_ids, **image, max_new_tokens=20, do_sample=False)
    other = {**image, "pixel_values": -3 * image["pixel_values"]}
    assert not torch.equal(plain, plain_generate(model, input_ids=input_ids, **other, max_new_tokens=20, do_sample=False))
    out = speculate(model, {"input_ids": input_ids, **image}, 20, method="draft_model", model=perturbed_copy(model),
                    num_speculative_tokens=3)  # fmt: skip
    assert torch.equal(out.sequences, plain) and out.spec_metrics["num_accepted_tokens"] > 0
    engine = hf_specdec.SpeculativeEngine(model, {"method": "ngram", "prompt_lookup_min": 1}, max_batch_size=2)
    request_id = engine.add_request(prompt, {"max_new_tokens": 20, "do_sample": False}, model_inputs=image)
    finished = {o.request_id: o.token_ids for _ in range(40) for o in engine.step() if o.finished}
    assert finished[request_id] == plain[0, len(prompt) :].tolist()
