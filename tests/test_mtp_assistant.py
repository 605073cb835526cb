"""method="mtp" with Gemma 4's assistant as `model` (`drafters/mtp_assistant.py`): an MTP drafter of its
own that attends to the target's KV cache.

The target is a tiny Gemma 4 whose last two layers reuse the KV of the two before them (as Gemma 4
E2B / E4B ship); the assistant is a tiny `Gemma4AssistantForCausalLM` for it. Its drafts are checked
against transformers' own `SinglePositionMultiTokenCandidateGenerator` on random weights. For
acceptance, the target's layers are damped (their post norms scaled down: its next token is then
mostly a function of the last one) and the assistant is made to guess that function (its input
projection passes the token's embedding through, its layers damped too, the target's head as its own).
"""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_batch, plain_generate
from test_architectures import long_prompts, speculate
from test_sampling_distribution import SETTINGS, chi_square_pvalue, exact_distribution, speculative_samples
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator
from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

import hf_specdec
from hf_specdec.cache.paged_attention import ModelMask
from hf_specdec.drafters.drafting import DraftTokenPicker
from hf_specdec.drafters.mtp_assistant import MtpAssistantProposer

SLIDING_WINDOW = 8


def damp_layers(model, scale: float) -> None:
    """Scale every decoder layer's post norms: its attention / MLP add that much less to the residual."""
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm"):
                norm = getattr(layer, name, None)
                if getattr(norm, "weight", None) is not None:
                    norm.weight.mul_(scale)


def gemma4_target(vocab_size: int = 128, seed: int = 0, initializer_range: float = 0.1, damped: bool = False):
    """4 layers (sliding, full, sliding, full), the last two reusing the first two's KV; full layers
    with a larger head size (Gemma 4's global_head_dim)."""
    import families

    text = families.tiny_config("gemma4").text_config.to_dict()  # the family matrix's: 4 layers, 2 reusing
    del text["model_type"]
    text.update(
        vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size, sliding_window=SLIDING_WINDOW,
        initializer_range=initializer_range, pad_token_id=0, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma4_text", **text)).eval()
    if damped:
        damp_layers(model, 0.1)
    return model


def gemma4_assistant(target, seed: int = 1, guesses: bool = False):
    """A Gemma 4 assistant for `target` (2 layers, every one reading the target's KV). `guesses`:
    shaped to draft what a damped target mostly emits (see the module docstring)."""
    text = target.config.to_dict()
    text.update(model_type="gemma4_text", hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_hidden_layers=2,
                layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=2,
                per_layer_config={i: c for i, c in text["per_layer_config"].items() if int(i) < 2})  # fmt: skip
    config = AutoConfig.for_model("gemma4_assistant", text_config=text, backbone_hidden_size=target.config.hidden_size)
    torch.manual_seed(seed)
    assistant = AutoModelForCausalLM.from_config(config).eval()
    if guesses:
        hidden = target.config.hidden_size
        damp_layers(assistant, 0.05)
        with torch.no_grad():
            assistant.pre_projection.weight.copy_(torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1))
            assistant.lm_head.weight.copy_(target.lm_head.weight)
    return assistant


def draft_step_logits(target, assistant, prompt: torch.Tensor, steps: int, window: int | None = None) -> list:
    """The logits the assistant hands the draft picker at each draft step of one generate() call
    (the first `steps` follow the prompt); `window`: its sliding layers' mask window instead of ours."""
    seen = []
    pick, init = DraftTokenPicker.pick, MtpAssistantProposer.__init__

    def recording_pick(self, logits, rows):
        seen.append(logits.clone())
        return pick(self, logits, rows)

    def with_window(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if window is not None:
            self.masks["sliding_attention"] = ModelMask(and_masks(causal_mask_function, sliding_window_overlay(window)))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DraftTokenPicker, "pick", recording_pick)
        patch.setattr(MtpAssistantProposer, "__init__", with_window)
        speculate(target, {"input_ids": prompt}, steps + 2, method="mtp", model=assistant, num_speculative_tokens=steps)
    return seen


def test_drafts_equal_transformers_candidate_generator():
    """After a prompt longer than the sliding window, the assistant's logits at each of 3 draft steps
    equal those of transformers' generator (which runs it on the target's shared KV states); its
    sliding layers read window + 1 keys there, and with the window itself the logits differ."""
    target = gemma4_target()
    assistant = gemma4_assistant(target)
    prompt = torch.tensor([long_prompts(1)[0]])  # 31 tokens > the window of 8
    with torch.no_grad():
        out = target(input_ids=prompt, output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
    input_ids = torch.cat([prompt, out.logits[:, -1:].argmax(-1)], dim=1)
    assistant.generation_config.num_assistant_tokens = 3
    generator = SinglePositionMultiTokenCandidateGenerator(assistant, target.get_input_embeddings(), target.generation_config)
    generator.main_model_max_length = 100
    with torch.no_grad():
        candidates, reference = generator.get_candidates(
            input_ids, {"attention_mask": torch.ones_like(input_ids)}, out, is_first_iteration=False, n_last_matches=0
        )
    assert candidates.shape[1] == input_ids.shape[1] + 3
    ours = draft_step_logits(target, assistant, prompt, steps=3)
    for step in range(3):
        torch.testing.assert_close(ours[step][0], reference[0, step], atol=1e-4, rtol=1e-4)
    narrower = draft_step_logits(target, assistant, prompt, steps=3, window=SLIDING_WINDOW)
    assert (narrower[0][0] - reference[0, 0]).abs().max() > 1e-3


def test_greedy_output_equals_plain_generate_in_generate_and_the_engine():
    """Three left-padded rows: drafts accepted and rejected, every row's tokens plain generate()'s;
    then the engine with a request joining mid-flight."""
    target = gemma4_target(damped=True)
    assistant = gemma4_assistant(target, guesses=True)
    inputs = left_padded_batch(long_prompts(3))
    plain = plain_generate(target, **inputs, max_new_tokens=30, do_sample=False)
    out = speculate(target, inputs, 30, method="mtp", model=assistant, num_speculative_tokens=3)
    accepted, drafted = out.spec_metrics["num_accepted_tokens"], out.spec_metrics["num_draft_tokens"]
    assert torch.equal(out.sequences, plain) and 0 < accepted < drafted, (accepted, drafted)

    prompts = long_prompts(2)
    engine = hf_specdec.SpeculativeEngine(target, {"method": "mtp", "model": assistant, "num_speculative_tokens": 3})
    first = engine.add_request(prompts[0], {"max_new_tokens": 20, "do_sample": False})
    finished = {o.request_id: o.token_ids for o in engine.step() if o.finished}
    second = engine.add_request(prompts[1], {"max_new_tokens": 20, "do_sample": False})
    for _ in range(40):
        finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    for request_id, prompt in ((first, prompts[0]), (second, prompts[1])):
        alone = plain_generate(target, input_ids=torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
        assert finished[request_id] == alone[0, len(prompt) :].tolist()
    assert engine.num_kv_blocks_used == 0


def test_assistant_loaded_from_its_folder(tmp_path):
    target = gemma4_target(damped=True)
    gemma4_assistant(target, guesses=True).save_pretrained(tmp_path / "assistant")
    inputs = left_padded_batch(long_prompts(2))
    plain = plain_generate(target, **inputs, max_new_tokens=16, do_sample=False)
    out = speculate(target, inputs, 16, method="mtp", model=str(tmp_path / "assistant"), num_speculative_tokens=2)
    assert torch.equal(out.sequences, plain) and out.spec_metrics["num_accepted_tokens"] > 0


def test_sampled_drafts_follow_the_target_distribution(monkeypatch):
    """16-token vocabulary: sampled assistant drafts pass the chi-square test against the exact
    distribution; drafting the argmax while reporting the sampled q fails it."""
    target = hf_specdec.enable(gemma4_target(vocab_size=16, initializer_range=0.3, damped=True))
    config = {"method": "mtp", "model": gemma4_assistant(target, guesses=True), "num_speculative_tokens": 2}
    sampling = SETTINGS["temperature_topk_topp"]
    exact = exact_distribution(target, sampling)
    assert max(exact.values()) < 0.5, "the distribution is nearly deterministic: the test would prove little"
    samples, metrics = speculative_samples(target, sampling, config, num_samples=4000, seed=11)
    assert all(0 < m["num_accepted_tokens"] < m["num_draft_tokens"] for m in metrics)
    assert chi_square_pvalue(samples, exact) > 1e-3

    sample = DraftTokenPicker._sample

    def argmax_drafts(self, logits, rows, sampling):
        _, q = sample(self, logits, rows, sampling)
        return logits.argmax(dim=-1), q

    monkeypatch.setattr(DraftTokenPicker, "_sample", argmax_drafts)
    samples, _ = speculative_samples(target, sampling, config, num_samples=4000, seed=11)
    assert chi_square_pvalue(samples, exact) < 1e-3


def test_targets_and_assistants_that_do_not_fit_are_refused():
    from conftest import build_tiny_llama

    target = gemma4_target()
    assistant = gemma4_assistant(target)
    llama = build_tiny_llama(0, vocab_size=128)
    inputs = left_padded_batch(long_prompts(1))
    with pytest.raises(ValueError, match=r"attends to the target's KV cache layers as Gemma 4 and Gemma 3n store them"):
        speculate(llama, inputs, 4, method="mtp", model=assistant)
    narrower = gemma4_assistant(target)
    narrower.config.backbone_hidden_size = 32
    with pytest.raises(ValueError, match=r"built for a target of hidden size 32; the target's is 64"):
        speculate(target, inputs, 4, method="mtp", model=narrower)
    with pytest.raises(ValueError, match=r"num_mtp_layers=None: pass its assistant model"):
        speculate(target, inputs, 4, method="mtp", model=build_tiny_llama(0, vocab_size=128))


def test_bench_compares_against_transformers_driving_the_same_assistant():
    """`hf-specdec bench --method mtp --draft <assistant>`: its "transformers" arm hands the assistant
    to transformers' own generate() (assistant_model), and both arms give plain generate()'s tokens."""
    from hf_specdec.bench.arms import BenchSettings, build_arms
    from hf_specdec.bench.runner import _generate

    target = hf_specdec.enable(gemma4_target(damped=True))
    assistant = gemma4_assistant(target, guesses=True)
    arms = {arm.name: arm for arm in build_arms(BenchSettings(method="mtp", k=3, draft=assistant, batch_size=1), target)}
    assert arms["transformers"].generate_kwargs["assistant_model"] is assistant
    prompt = torch.tensor([long_prompts(1)[0]])
    plain = plain_generate(target, input_ids=prompt, max_new_tokens=16, do_sample=False)
    for name in ("transformers", "ours"):
        kwargs = {"input_ids": prompt, "do_sample": False, "pad_token_id": 0, **arms[name].generate_kwargs}
        out = _generate(target, arms[name], kwargs, max_new_tokens=16)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        assert torch.equal(sequences, plain), name


def test_assistant_reads_through_the_kernel_as_through_the_reference(monkeypatch):
    """On CUDA the paged attention runs our Triton kernel (forced here under Triton's interpreter): the
    assistant's reads (one query per row at its last held position, windows of sliding_window + 1)
    give the reference path's draft logits, on the kernel and not a silent fallback."""
    from hf_specdec.cache import paged_attention
    from hf_specdec.kernels import paged_attention as kernel_module

    target = gemma4_target()
    assistant = gemma4_assistant(target)
    prompt = torch.tensor([long_prompts(1)[0]])
    reference = draft_step_logits(target, assistant, prompt, steps=3)
    windows = []
    launch = kernel_module.paged_attention
    monkeypatch.setattr(kernel_module, "paged_attention", lambda *a, **k: (windows.append(k["window"]), launch(*a, **k))[1])
    monkeypatch.setenv(paged_attention.BACKEND_ENV_VAR, "triton")
    kernel = draft_step_logits(target, assistant, prompt, steps=3)
    for step in range(3):
        torch.testing.assert_close(kernel[step], reference[step], atol=1e-4, rtol=1e-4)
    assert SLIDING_WINDOW + 1 in windows  # the assistant's sliding layers ran on the kernel
