"""Speculative generation on SmolLM2-135M-Instruct (fetched from PyPI) with the n-gram drafter.

    python examples/quickstart.py

Prints each completion, tokens/s of plain vs speculative greedy generate() (measured side by
side), whether the outputs are identical, and the acceptance metrics.
"""

from __future__ import annotations

import time

import torch

import hf_specdec
from hf_specdec.models.real_models import humaneval_prompts, load_smollm2

SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def main() -> None:
    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    hf_specdec.enable(model)  # the one opt-in line
    prompts = humaneval_prompts(tokenizer, limit=3)
    # one short untimed call first: on first use numba compiles the n-gram matcher, and the fp32 CPU
    # linears' routes are timed once ("auto", a few seconds): neither belongs in the tokens/s below
    warmup = tokenizer([prompts[0]], return_tensors="pt")
    model.generate(**warmup, max_new_tokens=2, do_sample=False, speculative_config=SPECULATIVE_CONFIG)
    plain_tokens = spec_tokens = 0
    plain_seconds = spec_seconds = 0.0
    for prompt in prompts:
        inputs = tokenizer([prompt], return_tensors="pt")
        start = time.perf_counter()
        plain = model.generate(**inputs, max_new_tokens=192, do_sample=False)
        plain_seconds += time.perf_counter() - start
        start = time.perf_counter()
        spec = model.generate(
            **inputs,
            max_new_tokens=192,
            do_sample=False,
            speculative_config=SPECULATIVE_CONFIG,
            return_dict_in_generate=True,
        )
        spec_seconds += time.perf_counter() - start
        new_tokens = spec.sequences[0, inputs.input_ids.shape[1] :]
        plain_tokens += plain.shape[1] - inputs.input_ids.shape[1]
        spec_tokens += len(new_tokens)
        print("-" * 80)
        print(tokenizer.decode(new_tokens, skip_special_tokens=True))
        print(
            f"[identical to plain generate: {torch.equal(plain, spec.sequences)}; "
            f"tau {spec.spec_metrics['mean_acceptance_length']:.2f}; "
            f"accepted per position {spec.spec_metrics['num_accepted_tokens_per_pos']}]"
        )
    metrics = model.spec_decode_metrics
    print("=" * 80)
    print(f"plain generate():       {plain_tokens / plain_seconds:6.1f} tokens/s")
    print(f"speculative generate(): {spec_tokens / spec_seconds:6.1f} tokens/s  "
          f"({plain_seconds / spec_seconds * spec_tokens / plain_tokens:.2f}x)")
    print(f"mean acceptance length (tau): {metrics.mean_acceptance_length:.2f}, "
          f"draft acceptance rate {metrics.draft_acceptance_rate:.2f}, "
          f"target forwards {metrics.num_target_forwards} for {metrics.num_emitted_tokens} tokens")


if __name__ == "__main__":
    main()
