"""EAGLE checkpoints: our format, the EAGLE authors' EAGLE-1/2 and EAGLE-3 layouts, SpecForge's and
vLLM speculators' EAGLE-3 layouts, `.bin` through weights_only, Hub ids from a local (offline) HF
cache, and heads that do not fit the target.

Every foreign checkpoint is synthetic: tensors with the published names and shapes, written by
the test, then loaded and checked (weights where expected, a forward, generate() unchanged).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import plain_generate, repeated_span_batch
from safetensors.torch import save_file

import hf_specdec
from hf_specdec.drafters import build_proposer
from hf_specdec.heads.eagle_heads import EagleHead, load_eagle_head

H, INTER, HEADS, KV_HEADS, HEAD_DIM, V = 64, 128, 4, 2, 16, 128  # conftest's tiny Llama
DRAFT_VOCAB = 96


def _rand(*shape, generator, dtype=torch.float16):
    return (torch.randn(*shape, generator=generator) * 0.05).to(dtype)


def _llama_layer(
    prefix: str,
    generator,
    in_features: int | None = None,
    input_norm: bool = True,
    hidden_norm: bool = False,
    hidden: int = H,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
):
    """One Llama decoder layer's tensors as the authors / vLLM name them."""
    in_features = in_features or hidden
    tensors = {
        f"{prefix}self_attn.q_proj.weight": _rand(heads * HEAD_DIM, in_features, generator=generator),
        f"{prefix}self_attn.k_proj.weight": _rand(kv_heads * HEAD_DIM, in_features, generator=generator),
        f"{prefix}self_attn.v_proj.weight": _rand(kv_heads * HEAD_DIM, in_features, generator=generator),
        f"{prefix}self_attn.o_proj.weight": _rand(hidden, heads * HEAD_DIM, generator=generator),
        f"{prefix}mlp.gate_proj.weight": _rand(INTER, hidden, generator=generator),
        f"{prefix}mlp.up_proj.weight": _rand(INTER, hidden, generator=generator),
        f"{prefix}mlp.down_proj.weight": _rand(hidden, INTER, generator=generator),
        f"{prefix}post_attention_layernorm.weight": 1 + _rand(hidden, generator=generator),
    }
    if input_norm:
        tensors[f"{prefix}input_layernorm.weight"] = 1 + _rand(hidden, generator=generator)
    if hidden_norm:
        tensors[f"{prefix}hidden_norm.weight"] = 1 + _rand(hidden, generator=generator)
    return tensors


def _llama_config(**overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "vocab_size": V,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 512,
        "torch_dtype": "float16",
    }
    config.update(overrides)
    return config


def authors_eagle1(generator) -> tuple[dict, dict]:
    """SafeAILab/EAGLE EAGLE-1/2 head (cnets1.py): fc with bias, layers.0 without input_layernorm."""
    state = {"fc.weight": _rand(H, 2 * H, generator=generator), "fc.bias": _rand(H, generator=generator)}
    state.update(_llama_layer("layers.0.", generator, input_norm=False))
    return _llama_config(bias=True), state


def _draft_map(generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randperm(V, generator=generator)[:DRAFT_VOCAB].sort().values
    d2t = ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids, d2t, t2d


def authors_eagle3(generator, layer_prefix: str = "midlayer.") -> tuple[dict, dict, torch.Tensor]:
    """SafeAILab/EAGLE EAGLE-3 head (cnets.py), also what SpecForge saves: midlayer.*, d2t / t2d."""
    ids, d2t, t2d = _draft_map(generator)
    state = {
        "fc.weight": _rand(H, 3 * H, generator=generator),
        "norm.weight": 1 + _rand(H, generator=generator),
        "lm_head.weight": _rand(DRAFT_VOCAB, H, generator=generator),
        "d2t": d2t,
        "t2d": t2d,
    }
    state.update(_llama_layer(layer_prefix, generator, in_features=2 * H, hidden_norm=True))
    config = _llama_config(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB)
    return config, state, ids


def speculators_eagle3(generator) -> tuple[dict, dict, torch.Tensor]:
    """vLLM speculators EAGLE-3 (two layers, own embedding, verifier copies that are ignored)."""
    ids, d2t, t2d = _draft_map(generator)
    state = {
        "embed_tokens.weight": _rand(V, H, generator=generator),
        "fc.weight": _rand(H, 3 * H, generator=generator),
        "norm.weight": 1 + _rand(H, generator=generator),
        "lm_head.weight": _rand(DRAFT_VOCAB, H, generator=generator),
        "d2t": d2t,
        "t2d": t2d,
        "verifier_norm.weight": torch.ones(H, dtype=torch.float16),
        "verifier_lm_head.weight": _rand(V, H, generator=generator),
    }
    state.update(_llama_layer("layers.0.", generator, in_features=2 * H, hidden_norm=True))
    state.update(_llama_layer("layers.1.", generator))
    layer_config = _llama_config(num_hidden_layers=2)
    del layer_config["architectures"], layer_config["torch_dtype"]
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer_config,
        "draft_vocab_size": DRAFT_VOCAB,
        "norm_before_residual": True,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "org/target"}},
    }
    return config, state, ids


def write_checkpoint(folder, config: dict, state: dict, weights: str = "safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder


def assert_generate_unchanged(model, method: str, head_source) -> dict:
    inputs = repeated_span_batch(3)
    plain = plain_generate(model, **inputs, max_new_tokens=16, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=16,
        do_sample=False,
        return_dict_in_generate=True,
        speculative_config={"method": method, "model": head_source, "num_speculative_tokens": 3},
    )
    assert torch.equal(out.sequences, plain)
    assert out.spec_metrics["num_draft_tokens"] > 0
    return out.spec_metrics


def assert_forward_runs(head: EagleHead, model) -> None:
    features = torch.randn(1, 5, 3 * H if head.method == "eagle3" else H)
    hidden = head(torch.tensor([[5, 6, 7, 8, 9]]), features, torch.arange(5)[None])
    assert hidden.shape == (1, 5, H) and torch.isfinite(hidden).all()
    logits = head.compute_logits(hidden)
    assert logits.shape[-1] == (DRAFT_VOCAB if head.method == "eagle3" else V)


# --- layouts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_authors_eagle1_layout(enabled_llama, tmp_path, weights):
    model = enabled_llama
    config, state = authors_eagle1(torch.Generator().manual_seed(0))
    folder = write_checkpoint(tmp_path / "eagle1", config, state, weights)
    head = load_eagle_head(folder, target=model, method="eagle")
    assert head.method == "eagle"
    assert torch.equal(head.fc.weight, state["fc.weight"].float())
    assert torch.equal(head.fc.bias, state["fc.bias"].float())
    assert torch.equal(head.layers[0].mlp.down_proj.weight, state["layers.0.mlp.down_proj.weight"].float())
    assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)
    assert head.embed_tokens is None and head.lm_head is None  # both borrowed from the target
    assert head.embed(torch.tensor([7])).equal(model.get_input_embeddings()(torch.tensor([7])))
    assert head.feature_layers_for(2) == (2,)  # the final norm's output
    assert_forward_runs(head, model)
    assert_generate_unchanged(model, "eagle", str(folder))


def test_authors_eagle3_layout(enabled_llama, tmp_path):
    model = enabled_llama
    config, state, ids = authors_eagle3(torch.Generator().manual_seed(1))
    folder = write_checkpoint(tmp_path / "eagle3", config, state)
    head = load_eagle_head(folder, target=model, method="eagle3")
    assert torch.equal(head.layers[0].self_attn.q_proj.weight, state["midlayer.self_attn.q_proj.weight"].float())
    assert torch.equal(head.layers[0].hidden_norm.weight, state["midlayer.hidden_norm.weight"].float())
    assert torch.equal(head.lm_head.weight, state["lm_head.weight"].float())
    assert torch.equal(head.draft_to_target(torch.arange(DRAFT_VOCAB)), ids)
    assert torch.equal(head.t2d, state["t2d"])
    assert head.layers[0].self_attn.q_proj.in_features == 2 * H
    assert head.feature_layers_for(2) == (2, 1, 0)  # (2, L // 2, L - 3) clamped into [0, L]
    assert_forward_runs(head, model)
    assert_generate_unchanged(model, "eagle3", str(folder))


def test_specforge_eagle3_layer_ids(enabled_llama, tmp_path):
    """SpecForge / SGLang name the layer whose *output* is taken: hidden_states index = id + 1."""
    config, state, _ = authors_eagle3(torch.Generator().manual_seed(2), layer_prefix="layers.0.")
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 0, 1], "use_aux_hidden_state": True}
    folder = write_checkpoint(tmp_path / "specforge", config, state)
    head = load_eagle_head(folder, target=enabled_llama, method="eagle3")
    assert head.feature_layers_for(2) == (1, 1, 2)
    assert torch.equal(head.layers[0].self_attn.k_proj.weight, state["layers.0.self_attn.k_proj.weight"].float())
    assert_generate_unchanged(enabled_llama, "eagle3", str(folder))


def test_speculators_eagle3_layout(enabled_llama, tmp_path):
    model = enabled_llama
    config, state, ids = speculators_eagle3(torch.Generator().manual_seed(3))
    folder = write_checkpoint(tmp_path / "speculators", config, state)
    head = load_eagle_head(folder, target=model, method="eagle3")
    assert len(head.layers) == 2 and head.layers[1].self_attn.q_proj.in_features == H
    assert head.layers[0].norm_before_residual
    assert head.embed_tokens is not None  # its own embedding, not the target's
    assert torch.equal(head.embed_tokens.weight, state["embed_tokens.weight"].float())
    assert torch.equal(head.layers[1].mlp.up_proj.weight, state["layers.1.mlp.up_proj.weight"].float())
    assert head.feature_layers_for(2) == (0, 1, 2)  # vLLM ids: hidden_states indices as they are
    assert torch.equal(head.draft_to_target(torch.arange(DRAFT_VOCAB)), ids)
    assert_forward_runs(head, model)
    assert_generate_unchanged(model, "eagle3", str(folder))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_own_format_round_trip(enabled_llama, tmp_path, method):
    model = enabled_llama
    draft_vocab = torch.arange(0, V, 2) if method == "eagle3" else None
    head = EagleHead.for_target(model, method, num_layers=2, draft_vocab=draft_vocab, seed=5)
    head.save_pretrained(tmp_path / "head")
    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert saved["format"] == "hf_specdec.eagle_head" and saved["method"] == method
    assert saved["decoder"]["num_hidden_layers"] == 2
    loaded = EagleHead.from_pretrained(tmp_path / "head", target=model)
    assert loaded.state_dict().keys() == head.state_dict().keys()
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert "embed_tokens.weight" not in loaded.state_dict()  # borrowed: never saved
    # the folder drafts exactly what the loaded module does
    from_folder = assert_generate_unchanged(model, method, str(tmp_path / "head"))
    from_module = assert_generate_unchanged(model, method, head)
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
        assert from_folder[key] == from_module[key], key


def test_hub_id_from_offline_cache(enabled_llama, tmp_path, monkeypatch):
    """A Hub id resolves through huggingface_hub's cache without network (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny-eagle3"
    config, state, _ = authors_eagle3(torch.Generator().manual_seed(4))
    write_checkpoint(repo / "snapshots" / commit, config, state)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_generate_unchanged(enabled_llama, "eagle3", "org/tiny-eagle3")
    # loaded once per target: a second build reuses the same module
    spec = hf_specdec.SpeculativeConfig(method="eagle3", model="org/tiny-eagle3")
    assert build_proposer(spec, enabled_llama).head is build_proposer(spec, enabled_llama).head


# --- refusals -----------------------------------------------------------------------------------
class _NotATensor:
    pass


def test_bin_needs_weights_only(enabled_llama, tmp_path):
    config, state = authors_eagle1(torch.Generator().manual_seed(0))
    state["fc.weight"] = _NotATensor()  # a pickle that only a full unpickle could load
    folder = write_checkpoint(tmp_path / "pickled", config, state, weights="bin")
    with pytest.raises(ValueError, match="weights_only"):
        load_eagle_head(folder, target=enabled_llama)


def test_hidden_size_mismatch(enabled_llama, tmp_path):
    generator = torch.Generator().manual_seed(0)
    # an EAGLE-1 head for a target of hidden size 32 (2 heads of 16 dims)
    state = {"fc.weight": _rand(32, 64, generator=generator), "fc.bias": _rand(32, generator=generator)}
    state.update(_llama_layer("layers.0.", generator, input_norm=False, hidden=32, heads=2, kv_heads=1))
    config = _llama_config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    folder = write_checkpoint(tmp_path / "small", config, state)
    with pytest.raises(ValueError, match="hidden size") as info:
        load_eagle_head(folder, target=enabled_llama, method="eagle")
    assert "32" in str(info.value) and "64" in str(info.value)


def test_vocabulary_mismatch(enabled_llama, tmp_path):
    config, state, _ = authors_eagle3(torch.Generator().manual_seed(1))
    config["vocab_size"] = 100
    state["t2d"] = torch.ones(100, dtype=torch.bool)
    state["d2t"] = torch.zeros(DRAFT_VOCAB, dtype=torch.long)
    folder = write_checkpoint(tmp_path / "vocab", config, state)
    with pytest.raises(ValueError, match="vocabulary") as info:
        load_eagle_head(folder, target=enabled_llama)
    assert "100" in str(info.value) and "128" in str(info.value)


def test_architecture_and_method_mismatch(enabled_llama, tmp_path):
    config, state, _ = authors_eagle3(torch.Generator().manual_seed(1))
    folder = write_checkpoint(tmp_path / "eagle3", config, state)
    with pytest.raises(ValueError, match="method='eagle3'"):
        load_eagle_head(folder, target=enabled_llama, method="eagle")
    with pytest.raises(ValueError, match="method='eagle3'"):
        enabled_llama.generate(
            **repeated_span_batch(1),
            max_new_tokens=4,
            speculative_config={"method": "eagle", "model": str(folder), "num_speculative_tokens": 2},
        )
    write_checkpoint(tmp_path / "qwen3", {**config, "model_type": "qwen3"}, state)
    with pytest.raises(ValueError, match="architecture"):
        load_eagle_head(tmp_path / "qwen3", target=enabled_llama)


def test_missing_and_misshapen_tensors(enabled_llama, tmp_path):
    config, state = authors_eagle1(torch.Generator().manual_seed(0))
    del state["layers.0.mlp.up_proj.weight"]
    write_checkpoint(tmp_path / "missing", config, state)
    with pytest.raises(ValueError, match="missing tensors.*up_proj"):
        load_eagle_head(tmp_path / "missing", target=enabled_llama)
    config, state = authors_eagle1(torch.Generator().manual_seed(0))
    state["layers.0.mlp.up_proj.weight"] = state["layers.0.mlp.up_proj.weight"][:, :10]
    write_checkpoint(tmp_path / "misshapen", config, state)
    with pytest.raises(ValueError, match="up_proj.weight has shape"):
        load_eagle_head(tmp_path / "misshapen", target=enabled_llama)

