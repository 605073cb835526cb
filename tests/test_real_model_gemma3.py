"""Gemma 3 270M (base, from PyPI): a real non-Llama model (sliding-window + full attention layers,
262k vocabulary, tied LM head). Greedy continuations are coherent, and speculative greedy == plain
greedy on a left-padded batch whose long row runs past the 512-token sliding window."""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec.models.real_models import humaneval_problems, load_gemma3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3():
    model, tokenizer = load_gemma3()
    return model, tokenizer


def _continue(model, tokenizer, prompt: str, new_tokens: int) -> str:
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)


def test_loads_as_gemma3(gemma3):
    model, tokenizer = gemma3
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config.model_type == "gemma3_text"
    assert "sliding_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    assert model.config.sliding_window == 512
    assert model.dtype == torch.float32
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id == 0
    assert tokenizer("Hello").input_ids[0] == tokenizer.bos_token_id == 2


def test_greedy_continuations_are_coherent(gemma3):
    model, tokenizer = gemma3
    assert _continue(model, tokenizer, "1, 2, 3, 4, 5,", 8).startswith(" 6, 7, 8")
    assert "100 degrees" in _continue(model, tokenizer, "Water boils at a temperature of", 8)
    code = _continue(model, tokenizer, "def fibonacci(n):", 16)
    assert "if n" in code and "return" in code


def test_speculative_greedy_identical_past_the_sliding_window(gemma3):
    model, tokenizer = gemma3
    model = hf_specdec.enable(model)
    problems = humaneval_problems()
    long_prompt = "\n\n".join(p["prompt"] for p in problems[:6])  # ~600 tokens: the window cuts
    prompts = [long_prompt, problems[0]["prompt"]]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    assert inputs.input_ids.shape[1] > model.config.sliding_window
    assert (inputs.attention_mask == 0).any(), "the batch is left padded"
    plain = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    spec = model.generate(
        **inputs,
        max_new_tokens=24,
        do_sample=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                            "prompt_lookup_max": 4},
        return_dict_in_generate=True,
    )
    assert torch.equal(plain, spec.sequences)
    assert spec.spec_metrics["num_accepted_tokens"] > 0
