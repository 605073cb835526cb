"""method="mtp": a tiny random DeepSeek-V3 with one MTP layer, saved as a checkpoint with its MTP
weights where DeepSeek keeps them (`model.layers.{num_hidden_layers}.*`), so that both
transformers' `generate(use_mtp=True)` and our drafter load them with `MtpModel.from_pretrained`.

The weights are shaped so the MTP layer often predicts what the target emits: the target's layers
add little to the residual stream (embedding -> head dominates) and the MTP layer's projection
passes the next token's embedding through. Drafts are then accepted and rejected.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import build_tiny_llama, plain_generate, repeated_span_batch
from safetensors.torch import load_file, save_file
from test_sampling_distribution import SETTINGS, chi_square_pvalue, exact_distribution, speculative_samples
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache
from transformers.generation import candidate_generator
from transformers.modeling_layers import MtpModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3PreTrainedModel

import hf_specdec
from hf_specdec.drafters import ProposeRequest
from hf_specdec.drafters.mtp import MtpProposer
from hf_specdec.models.feature_capture import PendingFeatures

NUM_LAYERS = 2


def deepseek_config(vocab_size: int = 128, **overrides) -> DeepseekV3Config:
    options = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,  # layer 0 dense, layer 1 and the MTP layer MoE
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=12,  # values narrower than keys (qk 16 + 8): MLA's different head dims
        qk_nope_head_dim=16,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        initializer_range=0.1,
        num_mtp_layers=1,
    )
    return DeepseekV3Config(**{**options, **overrides})


def build_pair(config: DeepseekV3Config, seed: int = 0) -> tuple[DeepseekV3ForCausalLM, MtpModel]:
    """A target whose layers are weak and an MTP layer that mostly passes the token embedding through."""
    torch.manual_seed(seed)
    target = DeepseekV3ForCausalLM(config).eval()
    mtp = MtpModel(target, config.num_mtp_layers).eval()

    def weaken(layer, scale: float = 0.02) -> None:
        layer.self_attn.o_proj.weight.mul_(scale)
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.down_proj.mul_(scale)
            layer.mlp.shared_experts.down_proj.weight.mul_(scale)
        else:
            layer.mlp.down_proj.weight.mul_(scale)

    with torch.no_grad():
        # MtpModel's own init leaves DeepSeek's fused expert tensors as torch.empty (its generic
        # _init_weights does not know them): initialize every MTP parameter here
        for name, parameter in mtp.layers.named_parameters():
            parameter.fill_(1.0) if "norm" in name else parameter.normal_(0.0, config.initializer_range)
        for name, buffer in mtp.layers.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.zero_()
        for layer in target.model.layers:
            weaken(layer)
        weaken(mtp.layers[0].mtp_block)
        projection = mtp.layers[0].eh_proj.weight  # [hidden, 2 * hidden]: (embedding, hidden state) in
        projection.mul_(0.2)
        projection[:, : config.hidden_size] += torch.eye(config.hidden_size)
    return target, mtp


def save_with_mtp_weights(target: DeepseekV3ForCausalLM, mtp: MtpModel, folder: str) -> None:
    """The target's checkpoint plus the MTP layer as DeepSeek stores it (`model.layers.{L}.*`,
    experts one by one: `mlp.experts.{e}.gate_proj / up_proj / down_proj.weight`)."""
    target.save_pretrained(folder)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    prefix = f"model.layers.{NUM_LAYERS}."
    layer = mtp.layers[0]
    for name, value in layer.mtp_block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":  # [experts, 2 * intermediate, hidden]: gate rows, then up rows
            gate, up = value.chunk(2, dim=1)
            for expert in range(value.shape[0]):
                weights[f"{prefix}mlp.experts.{expert}.gate_proj.weight"] = gate[expert].clone()
                weights[f"{prefix}mlp.experts.{expert}.up_proj.weight"] = up[expert].clone()
        elif name == "mlp.experts.down_proj":  # [experts, hidden, intermediate]
            for expert in range(value.shape[0]):
                weights[f"{prefix}mlp.experts.{expert}.down_proj.weight"] = value[expert].clone()
        else:
            weights[prefix + name] = value.clone()
    for name, parameter in (
        ("enorm", layer.enorm.weight),
        ("hnorm", layer.hnorm.weight),
        ("eh_proj", layer.eh_proj.weight),
        ("shared_head.norm", layer.post_norm.weight),
    ):
        weights[f"{prefix}{name}.weight"] = parameter.detach().clone()
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(folder, "model.safetensors"))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The DeepSeek-V3 target loaded from its checkpoint (MTP weights read from there on demand)."""
    folder = str(tmp_path_factory.mktemp("deepseek_mtp"))
    built_target, built_mtp = build_pair(deepseek_config())
    save_with_mtp_weights(built_target, built_mtp, folder)
    with pytest.MonkeyPatch.context() as patch:
        # transformers finds DeepSeek's MTP weights by this pattern, written for the 61-layer model
        patch.setattr(
            DeepseekV3PreTrainedModel,
            "_keys_to_ignore_on_load_unexpected",
            [rf"model\.layers\.{NUM_LAYERS}.*"],
        )
        model = DeepseekV3ForCausalLM.from_pretrained(folder).eval()
        # the checkpoint round-trips: what transformers loads is the MTP layer we built
        loaded = MtpModel.from_pretrained(model).state_dict()
        for name, value in built_mtp.state_dict().items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
        yield hf_specdec.enable(model)


def mtp_config(k: int = 1, **extra) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, **extra}


class DraftRecorder:
    """Records (context, drafts) of every call, ours and transformers'."""

    def __init__(self, monkeypatch):
        self.ours: list[tuple[tuple[int, ...], list[int]]] = []
        self.theirs: list[tuple[tuple[int, ...], list[int]]] = []
        propose, get_candidates = (
            MtpProposer.propose,
            candidate_generator.MTPCandidateGenerator.get_candidates,
        )

        def recording_propose(proposer, request):
            proposal = propose(proposer, request)
            for tokens, drafted in zip(request.token_ids, proposal.draft_token_ids):
                self.ours.append((tuple(tokens.tolist()), drafted.tolist()))
            return proposal

        def recording_get_candidates(generator, input_ids, *args, **kwargs):
            candidates, logits = get_candidates(generator, input_ids, *args, **kwargs)
            self.theirs.append((tuple(input_ids[0].tolist()), candidates[0, input_ids.shape[1] :].tolist()))
            return candidates, logits

        monkeypatch.setattr(MtpProposer, "propose", recording_propose)
        monkeypatch.setattr(
            candidate_generator.MTPCandidateGenerator, "get_candidates", recording_get_candidates
        )


@pytest.mark.parametrize("prompt_seed", [0, 1, 2])
def test_batch_one_drafts_and_output_equal_transformers_use_mtp(target, monkeypatch, prompt_seed):
    recorder = DraftRecorder(monkeypatch)
    inputs = repeated_span_batch(1, seed=prompt_seed)
    plain = plain_generate(target, **inputs, max_new_tokens=30, do_sample=False)
    theirs = plain_generate(target, **inputs, max_new_tokens=30, do_sample=False, use_mtp=True)
    ours = target.generate(
        **inputs,
        max_new_tokens=30,
        do_sample=False,
        speculative_config=mtp_config(1),
        return_dict_in_generate=True,
    )
    assert torch.equal(theirs, plain)
    assert torch.equal(ours.sequences, plain)
    our_drafts = {context: drafted for context, drafted in recorder.ours if drafted}
    their_drafts = {context: drafted for context, drafted in recorder.theirs if drafted}
    common = set(our_drafts) & set(their_drafts)
    # the same contexts come up on both sides (the outputs agree); transformers may draft once
    # more at the very end, where we stop drafting at max_length
    assert len(common) >= len(their_drafts) - 1 and len(common) == len(our_drafts)
    assert {c: our_drafts[c] for c in common} == {c: their_drafts[c] for c in common}
    metrics = ours.spec_metrics
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"], metrics


@pytest.mark.parametrize("batch_size,k", [(3, 1), (3, 3), (5, 2)])
def test_batch_output_exact(target, batch_size, k):
    inputs = repeated_span_batch(batch_size)
    plain = plain_generate(target, **inputs, max_new_tokens=30, do_sample=False)
    out = target.generate(
        **inputs,
        max_new_tokens=30,
        do_sample=False,
        speculative_config=mtp_config(k),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    metrics = out.spec_metrics
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"], metrics


def reference_recursive_drafts(target, mtp: MtpModel, context: list[int], k: int) -> list[int]:
    """k drafts with one MTP layer reused recursively, the plain way: the target's final hidden
    states from a full forward, the MTP layer over the whole context with a DynamicCache, then
    one token at a time fed with the layer's own previous output."""
    input_ids = torch.tensor([context])
    n = len(context)
    hidden = target(input_ids=input_ids, output_hidden_states=True).hidden_states[-1]
    cache = DynamicCache(config=mtp.config)
    output = mtp.forward_layer(0, hidden[:, :-1], torch.arange(1, n)[None], cache, input_ids=input_ids[:, 1:])
    previous, drafts = output[:, -1:], []
    for step in range(k):
        drafts.append(int(mtp._project_to_logits(previous)[0, -1].argmax()))
        if step + 1 < k:
            previous = mtp.forward_layer(
                0, previous, torch.tensor([[n + step]]), cache, input_ids=torch.tensor([[drafts[-1]]])
            )
    return drafts


def test_k_beyond_the_mtp_layers_reuses_the_last_layer(target, monkeypatch):
    """k = 3 with one MTP layer, batch 3: each row's drafts equal the plain recursive reference
    (so batching, the paged MLA cache and the rollback of speculative entries are right), and
    drafts past the first are accepted too."""
    recorder = DraftRecorder(monkeypatch)
    inputs = repeated_span_batch(3)
    plain = plain_generate(target, **inputs, max_new_tokens=24, do_sample=False)
    out = target.generate(
        **inputs,
        max_new_tokens=24,
        do_sample=False,
        speculative_config=mtp_config(3),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    assert len(out.spec_metrics["num_accepted_tokens_per_pos"]) >= 2
    assert out.spec_metrics["num_accepted_tokens_per_pos"][1] > 0
    mtp = hf_specdec.drafters.mtp._LOADED[target]
    checked = 0
    with torch.no_grad():
        for context, drafted in recorder.ours:
            if len(drafted) == 3:
                assert drafted == reference_recursive_drafts(target, mtp, list(context), 3)
                checked += 1
    assert checked >= 10


def test_rows_not_drafting_leave_their_states_waiting(target, monkeypatch):
    """k = 0 calls (one new hidden state each, as a plain decode step gives) run no MTP forward: the
    states wait in the loop's queue, and the first call that drafts feeds them all at once, with
    the drafts of a layer fed every step. Past MAX_PENDING_POSITIONS a row feeds them anyway."""
    from hf_specdec.drafters import drafting

    mtp = hf_specdec.drafters.mtp.load_mtp_model(None, target)
    context = [5, 9, 14, 5, 9, 14, 7, 22, 31, 40, 5, 9]
    with torch.no_grad():
        hidden = target(input_ids=torch.tensor([context]), output_hidden_states=True).hidden_states[-1][0]
    n, first, k = len(context), 3, 2

    def propose(proposer, queue, length, new_states, max_draft):
        queue.add(0, new_states)
        request = ProposeRequest(
            rows=[0], token_ids=[np.array(context[:length])], max_draft_tokens=[max_draft], target_features=queue
        )
        return proposer.propose(request)

    def quiet_then_draft():
        proposer, queue = MtpProposer(target, mtp, k, max_length=64), PendingFeatures()
        propose(proposer, queue, first, hidden[: first - 1], 0)
        held = []
        for length in range(first + 1, n):  # one decode step per token, none drafting
            assert propose(proposer, queue, length, hidden[length - 2 : length - 1], 0).num_draft_tokens == [0]
            held.append(proposer.cache.seq_lens.get(0, 0))
            assert held[-1] + queue.count(0) == length - 1  # every state is either fed or waiting
        return held, propose(proposer, queue, n, hidden[n - 2 : n - 1], k).draft_token_ids[0]

    direct = propose(MtpProposer(target, mtp, k, max_length=64), PendingFeatures(), n, hidden[: n - 1], k)
    held, deferred = quiet_then_draft()
    monkeypatch.setattr(drafting, "MAX_PENDING_POSITIONS", 4)
    capped_held, capped = quiet_then_draft()
    assert held == [0] * len(held)  # no MTP forward while not drafting
    assert max(capped_held) > 0 and all(count % 4 == 0 for count in capped_held)  # fed in backlogs of 4
    assert len(direct.draft_token_ids[0]) == k
    np.testing.assert_array_equal(deferred, direct.draft_token_ids[0])
    np.testing.assert_array_equal(capped, direct.draft_token_ids[0])


def test_first_step_drafts_nothing_then_every_step_drafts(target, monkeypatch):
    recorder = DraftRecorder(monkeypatch)
    inputs = repeated_span_batch(2)
    target.generate(**inputs, max_new_tokens=12, do_sample=False, speculative_config=mtp_config(2))
    first_step = recorder.ours[:2]
    assert all(drafted == [] for _, drafted in first_step)
    assert all(len(drafted) > 0 for _, drafted in recorder.ours[2:6])


def test_sampled_mtp_drafts_follow_the_target_distribution():
    """16-token vocabulary: the output of sampled MTP drafts passes the chi-square test."""
    model, mtp = build_pair(
        deepseek_config(vocab_size=16, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    )
    model = hf_specdec.enable(model)
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_distribution(model, sampling)
    samples, metrics = speculative_samples(
        model, sampling, mtp_config(2, model=mtp), num_samples=4000, seed=5
    )
    assert all(0 < m["num_accepted_tokens"] < m["num_draft_tokens"] for m in metrics)
    assert chi_square_pvalue(samples, exact) > 1e-3


# --- errors ------------------------------------------------------------------------------------


def test_model_without_mtp_layers_rejected():
    llama = hf_specdec.enable(build_tiny_llama())
    with pytest.raises(ValueError, match="num_mtp_layers") as info:
        llama.generate(**repeated_span_batch(1), max_new_tokens=4, speculative_config=mtp_config(2))
    assert "'llama'" in str(info.value)
    no_mtp = hf_specdec.enable(DeepseekV3ForCausalLM(deepseek_config(num_mtp_layers=0)).eval())
    with pytest.raises(ValueError, match="num_mtp_layers=0"):
        no_mtp.generate(**repeated_span_batch(1), max_new_tokens=4, speculative_config=mtp_config(2))


def test_checkpoint_without_mtp_weights_rejected(tmp_path):
    model, _ = build_pair(deepseek_config())
    model.save_pretrained(tmp_path)  # the main model's weights only
    model = hf_specdec.enable(DeepseekV3ForCausalLM.from_pretrained(tmp_path).eval())
    with pytest.raises(ValueError, match="could not load the MTP layers"):
        model.generate(**repeated_span_batch(1), max_new_tokens=4, speculative_config=mtp_config(2))


def test_wrong_model_value_rejected(target):
    with pytest.raises(ValueError, match="MtpModel"):
        target.generate(
            **repeated_span_batch(1), max_new_tokens=4, speculative_config=mtp_config(2, model="x/y")
        )


def test_several_mtp_layers_not_supported_yet():
    model = DeepseekV3ForCausalLM(deepseek_config(num_mtp_layers=2)).eval()
    mtp = MtpModel(model, 2)
    model = hf_specdec.enable(model)
    with pytest.raises(NotImplementedError, match="num_mtp_layers=2"):
        model.generate(
            **repeated_span_batch(1), max_new_tokens=4, speculative_config=mtp_config(2, model=mtp)
        )
