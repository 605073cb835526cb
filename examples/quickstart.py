"""Speculative generation on SmolLM2-135M-Instruct (fetched from PyPI) with the n-gram drafter.

    python examples/quickstart.py

Prints each completion, whether it is identical to plain greedy generate(), the acceptance
metrics, and two speedups, each the median over prompts of a per-prompt tokens/s ratio, all arms
timed back to back per prompt in one process (the order reversed from one prompt to the next):

- x plain generate(): against transformers' plain decoding as it comes;
- x plain + fast linears: against plain generate() inside `hf_specdec.fast_cpu_linears(model)`,
  the same fp32 CPU linears the speculative loop uses. On a CPU part of the first ratio is those
  linears, which plain decoding can have too; this second ratio is what speculation adds by itself
  (what `hf-specdec bench --plain-fast-linears` reports). On a GPU the two are the same.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

import hf_specdec
from hf_specdec.models.real_models import humaneval_prompts, load_smollm2

SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
MAX_NEW_TOKENS = 192
ARMS = ("plain", "plain + fast linears", "speculative")


def run_arm(model, inputs, arm: str, max_new_tokens: int):
    """One greedy generate() call of `arm`; returns (output, new tokens, seconds)."""
    start = time.perf_counter()
    if arm == "speculative":
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            speculative_config=SPECULATIVE_CONFIG,
            return_dict_in_generate=True,
        )
        sequences = out.sequences
    else:
        linears = hf_specdec.fast_cpu_linears(model) if arm == "plain + fast linears" else contextlib.nullcontext()
        with torch.no_grad(), linears:
            out = sequences = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    return out, sequences.shape[1] - inputs.input_ids.shape[1], seconds


def main() -> None:
    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    hf_specdec.enable(model)  # the one opt-in line
    prompts = humaneval_prompts(tokenizer, limit=3)
    # one short untimed call per arm first: on first use numba compiles the n-gram matcher and the
    # small-batch kernel, and the fp32 CPU linears' routes are timed once per process ("auto", a few
    # seconds): none of that belongs in the tokens/s below
    warmup = tokenizer([prompts[0]], return_tensors="pt")
    for arm in ARMS:
        run_arm(model, warmup, arm, max_new_tokens=2)
    model.spec_decode_metrics = hf_specdec.SpecDecodeMetrics()  # count the timed calls only
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for number, prompt in enumerate(prompts):
        inputs = tokenizer([prompt], return_tensors="pt")
        outputs = {}
        for arm in ARMS if number % 2 == 0 else reversed(ARMS):  # alternate the order: noise hits all arms alike
            outputs[arm], new_tokens, seconds = run_arm(model, inputs, arm, MAX_NEW_TOKENS)
            rates[arm].append(new_tokens / seconds)
        spec, plain = outputs["speculative"], outputs["plain"]
        new_tokens = spec.sequences[0, inputs.input_ids.shape[1] :]
        print("-" * 80)
        print(tokenizer.decode(new_tokens, skip_special_tokens=True))
        print(
            f"[identical to plain generate: {torch.equal(plain, spec.sequences)}; "
            f"tau {spec.spec_metrics['mean_acceptance_length']:.2f}; "
            f"accepted per position {spec.spec_metrics['num_accepted_tokens_per_pos']}]"
        )
    spec_rates = rates["speculative"]
    vs_plain = statistics.median(s / p for s, p in zip(spec_rates, rates["plain"]))
    vs_fast = statistics.median(s / p for s, p in zip(spec_rates, rates["plain + fast linears"]))
    metrics = model.spec_decode_metrics
    print("=" * 80)
    print(f"tokens/s, median over {len(prompts)} prompts (each arm timed back to back per prompt):")
    for arm in ARMS:
        print(f"  {arm + ':':24s}{statistics.median(rates[arm]):6.1f}")
    print(f"speculative: {vs_plain:.2f}x plain generate(), {vs_fast:.2f}x plain generate() with the same CPU linears")
    print(f"mean acceptance length (tau): {metrics.mean_acceptance_length:.2f}, "
          f"draft acceptance rate {metrics.draft_acceptance_rate:.2f}, "
          f"target forwards {metrics.num_target_forwards} for {metrics.num_emitted_tokens} tokens")


if __name__ == "__main__":
    main()
