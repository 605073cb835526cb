"""The bench's "transformers" arm drafts at ours' k: transformers reads the number of candidates from
the assistant's generation config, not from generate()'s arguments."""

from __future__ import annotations

import torch
from conftest import EOS_TOKEN_ID, PAD_TOKEN_ID, build_tiny_llama

import hf_specdec
from hf_specdec.bench.arms import BenchSettings, build_arms
from hf_specdec.bench.runner import _generate


def test_transformers_arm_verifies_at_most_k_plus_one_tokens():
    target, draft = hf_specdec.enable(build_tiny_llama()), build_tiny_llama()  # the same weights: every draft accepted
    k = 3
    draft.generation_config.assistant_confidence_threshold = 0  # no early stop on this flat random model
    settings = BenchSettings(method="draft_model", k=k, draft=draft, batch_size=1)
    (arm,) = [arm for arm in build_arms(settings, target) if arm.name == "transformers"]
    verified = []
    forward = target.forward

    def counting_forward(*args, **kwargs):
        verified.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    target.forward = counting_forward
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    out = _generate(
        target, arm, {"input_ids": prompt, "do_sample": False, "pad_token_id": PAD_TOKEN_ID,
                      "eos_token_id": EOS_TOKEN_ID, **arm.generate_kwargs}, max_new_tokens=16,
    )  # fmt: skip
    assert out.shape[1] > prompt.shape[1]
    assert draft.generation_config.num_assistant_tokens == k
    assert draft.generation_config.num_assistant_tokens_schedule == "constant"
    decode_forwards = verified[1:]  # after the prompt's
    assert decode_forwards and max(decode_forwards) <= k + 1, verified  # 20 candidates before the fix
    assert max(decode_forwards) == k + 1  # the draft agrees: full k drafts verified
