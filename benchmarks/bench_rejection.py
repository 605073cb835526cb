"""What rejection sampling costs: its share of a CPU decode step, and the Triton kernels vs the
PyTorch reference on a GPU.

    python benchmarks/bench_rejection.py                  # CPU part, then the GPU part if CUDA is there
    python benchmarks/bench_rejection.py --prompts 1 --max-new-tokens 32      # quick CPU smoke run
    python benchmarks/bench_rejection.py --gpu-only --out results/bench_rejection_gpu.json

CPU part: SmolLM2-135M-Instruct speculative generate() on HumanEval prompts (n-gram drafter,
k=5, prompt lookup 2..4), greedy and sampled (temperature 0.7), at batch 1 and 8. Printed per
arm: decode steps, the sampler's milliseconds per step and its share of the whole call,
`spec_metrics['sampler_seconds'] / spec_metrics['total_seconds']`. The sampler's time covers
the logits processors, the random draws and `rejection_sample` (the reference, on CPU).

GPU part (when `torch.cuda.is_available()`): first the decode loop on CUDA tensors (a tiny random
Llama: speculative greedy generate() against plain generate(), and seeded sampling with the
kernels against the reference); then `rejection_sample_triton` vs
`rejection_sample_reference` on random tensors (no model, no download) for batch 1..256,
k 1..8, vocabularies of 50k and 150k, greedy rows, sampled rows with one-hot drafts and sampled
rows with draft probabilities. Each call includes the shared softmax; times are CUDA-event
medians over repeats after warm-up, and every configuration checks that both backends emit
identical tokens. Stops starting new configurations after --gpu-budget-s (default 240 s), so it
ends within 5 minutes on an H100 / H200. Last, what transformers' temperature, top-k and top-p
warpers cost on the same verify logits, next to the kernels' whole step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import hf_specdec
from hf_specdec.sampling.metadata import SpecDecodeMetadata
from hf_specdec.sampling.rejection_sampler import (
    BACKEND_ENV_VAR,
    RandomDraws,
    rejection_backend,
    rejection_sample_reference,
)

GPU_BATCH_SIZES = (1, 4, 16, 64, 256)
GPU_NUM_DRAFTS = (1, 2, 4, 8)
GPU_VOCAB_SIZES = (50_000, 150_000)
GPU_MODES = ("greedy", "sampled", "sampled_draft_probs")


# --- CPU: the sampler's share of a SmolLM2 decode step ------------------------------------------


def cpu_sampler_share(args: argparse.Namespace) -> list[dict]:
    from hf_specdec.models.real_models import humaneval_prompts, load_smollm2

    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    hf_specdec.enable(model)
    prompts = humaneval_prompts(tokenizer, limit=args.prompts)
    config = {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
        "seed": 0,
    }
    arms = {"greedy": {"do_sample": False}, "sampled": {"do_sample": True, "temperature": 0.7}}
    backend = rejection_backend(model.device)
    print(f"CPU: SmolLM2-135M, {len(prompts)} HumanEval prompt(s), rejection backend {backend}", flush=True)
    print(
        f"{'arm':>8} {'batch':>5} {'steps':>6} {'sampler ms/step':>16} {'step ms':>8} {'sampler share':>14}"
    )
    runs = []
    for arm, sampling in arms.items():
        # untimed first call: one-time costs (the n-gram matcher's JIT compile, allocator warm-up)
        warmup = tokenizer(prompts[:1], return_tensors="pt")
        model.generate(**warmup, max_new_tokens=8, speculative_config=config, **sampling)
        for batch_size in args.batch_sizes:
            # batches of batch_size prompts, cycling through the prompts when there are fewer
            batches = [
                [prompts[(start + i) % len(prompts)] for i in range(batch_size)]
                for start in range(0, len(prompts), batch_size)
            ]
            sampler = total = 0.0
            steps = 0
            for batch in batches:
                inputs = tokenizer(batch, return_tensors="pt", padding=True)
                out = model.generate(
                    **inputs,
                    max_new_tokens=args.max_new_tokens,
                    speculative_config=config,
                    return_dict_in_generate=True,
                    **sampling,
                )
                sampler += out.spec_metrics["sampler_seconds"]
                total += out.spec_metrics["total_seconds"]
                steps += out.spec_metrics["num_target_forwards"]
            run = {
                "arm": arm,
                "batch_size": batch_size,
                "steps": steps,
                "sampler_ms_per_step": 1000 * sampler / steps,
                "step_ms": 1000 * total / steps,
                "sampler_share": sampler / total,
            }
            runs.append(run)
            print(
                f"{arm:>8} {batch_size:>5} {steps:>6} "
                f"{run['sampler_ms_per_step']:>16.3f} {run['step_ms']:>8.2f} "
                f"{100 * run['sampler_share']:>13.2f}%",
                flush=True,
            )
    return runs


# --- GPU: kernels vs reference -------------------------------------------------------------------


def gpu_case(batch_size: int, num_drafts: int, vocab_size: int, mode: str, device: torch.device) -> dict:
    """A step where every row drafts k tokens, 70% of them the target's argmax (so runs get accepted)."""
    generator = torch.Generator(device=device).manual_seed(batch_size * 1000 + num_drafts)
    num_logits = batch_size * (num_drafts + 1)
    logits = torch.randn(num_logits, vocab_size, device=device, generator=generator) * 3.0
    metadata = SpecDecodeMetadata.from_drafts(
        [np.zeros(num_drafts, dtype=np.int64)] * batch_size, device=device
    )
    draft_logits = metadata.target_logits_indices
    argmax = logits[draft_logits].argmax(dim=-1)
    random_drafts = torch.randint(0, vocab_size, argmax.shape, device=device, generator=generator)
    keep = torch.rand(argmax.shape, device=device, generator=generator) < 0.7
    metadata.draft_token_ids = torch.where(keep, argmax, random_drafts)
    draft_probs = None
    if mode == "sampled_draft_probs":
        draft_probs = torch.softmax(
            torch.randn(len(draft_logits), vocab_size, device=device, generator=generator), -1
        )
    draws = None
    if mode != "greedy":
        draws = RandomDraws(
            uniform=torch.rand(len(draft_logits), device=device, generator=generator),
            exponential=torch.empty(batch_size, vocab_size, device=device).exponential_(generator=generator),
        )
    is_greedy = torch.full((batch_size,), mode == "greedy", dtype=torch.bool, device=device)
    return {
        "metadata": metadata,
        "logits": logits,
        "is_greedy": is_greedy,
        "draws": draws,
        "draft_probs": draft_probs,
    }


def cuda_median_ms(function, case: dict, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        function(**case)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function(**case)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gpu_kernels_vs_reference(args: argparse.Namespace) -> list[dict]:
    from hf_specdec.kernels.rejection import rejection_sample_triton

    device = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(device)}; median of {args.repeats} calls, ms", flush=True)
    print(
        f"{'mode':>20} {'vocab':>7} {'batch':>5} {'k':>2} "
        f"{'reference':>10} {'triton':>8} {'speedup':>8} {'same':>5}"
    )
    started = time.perf_counter()
    runs = []
    for mode in GPU_MODES:
        for vocab_size in GPU_VOCAB_SIZES:
            for batch_size in GPU_BATCH_SIZES:
                for num_drafts in GPU_NUM_DRAFTS:
                    if time.perf_counter() - started > args.gpu_budget_s:
                        print(
                            f"time budget of {args.gpu_budget_s} s spent: "
                            "the remaining configurations are skipped"
                        )
                        return runs
                    case = gpu_case(batch_size, num_drafts, vocab_size, mode, device)
                    expected = rejection_sample_reference(**case)
                    got = rejection_sample_triton(**case)
                    same = all(torch.equal(a, b) for a, b in zip(expected, got))
                    reference_ms = cuda_median_ms(rejection_sample_reference, case, args.warmup, args.repeats)
                    triton_ms = cuda_median_ms(rejection_sample_triton, case, args.warmup, args.repeats)
                    run = {
                        "mode": mode,
                        "vocab_size": vocab_size,
                        "batch_size": batch_size,
                        "num_drafts": num_drafts,
                        "reference_ms": reference_ms,
                        "triton_ms": triton_ms,
                        "speedup": reference_ms / triton_ms,
                        "identical": same,
                    }
                    runs.append(run)
                    print(
                        f"{mode:>20} {vocab_size:>7} {batch_size:>5} {num_drafts:>2} {reference_ms:>10.3f} "
                        f"{triton_ms:>8.3f} {run['speedup']:>7.2f}x {'yes' if same else 'NO':>5}",
                        flush=True,
                    )
                    del case
    mismatches = sum(not run["identical"] for run in runs)
    print(f"{len(runs)} configurations, {mismatches} with differing outputs")
    return runs


def gpu_sampling_parameters_cost(args: argparse.Namespace) -> list[dict]:
    """What transformers' temperature / top-k / top-p warpers cost on a step's verify logits, next to
    the kernels' whole rejection step: where a fused kernel for them would pay."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from hf_specdec.kernels.rejection import rejection_sample_triton

    device = torch.device("cuda")
    warpers = {
        "temperature": TemperatureLogitsWarper(0.7),
        "top_k": TopKLogitsWarper(50),
        "top_p": TopPLogitsWarper(0.9),
    }
    print("transformers' warpers on the verify logits vs the rejection kernels, ms")
    runs = []
    for vocab_size in GPU_VOCAB_SIZES:
        for batch_size, num_drafts in ((1, 4), (16, 4), (64, 4), (256, 4), (256, 8)):
            case = gpu_case(batch_size, num_drafts, vocab_size, "sampled", device)
            input_ids = torch.zeros(case["logits"].shape[0], 8, dtype=torch.long, device=device)
            run = {"vocab_size": vocab_size, "batch_size": batch_size, "num_drafts": num_drafts}
            for name, warper in warpers.items():
                run[f"{name}_ms"] = cuda_median_ms(
                    lambda warper=warper, input_ids=input_ids, **case: warper(
                        input_ids, case["logits"].clone()
                    ),
                    case,
                    args.warmup,
                    args.repeats,
                )
            run["rejection_kernels_ms"] = cuda_median_ms(
                rejection_sample_triton, case, args.warmup, args.repeats
            )
            runs.append(run)
            print(
                f"vocab {vocab_size:>6} batch {batch_size:>3} k {num_drafts}: "
                + " ".join(f"{key[:-3]} {value:.3f}" for key, value in run.items() if key.endswith("_ms")),
                flush=True,
            )
            del case
    return runs


def gpu_decode_loop_check(device: torch.device) -> dict:
    """The decode loop on CUDA tensors, on a tiny random Llama (fp32): speculative greedy generate()
    equals plain generate() token for token, and seeded speculative sampling emits the same tokens
    with the kernels as with the reference (same per-row draws)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(config).to(device).eval()
    # left-padded rows of different lengths, each a span repeated so that n-gram drafts get accepted
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (length,), generator=generator).repeat(3) for length in (4, 6, 9, 5)]
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = prompt
        attention_mask[row, width - len(prompt) :] = 1
    inputs = {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device),
        "max_new_tokens": 64,
    }
    speculative = {
        "custom_generate": hf_specdec.generate,
        "return_dict_in_generate": True,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 5, "seed": 7},
    }

    plain = model.generate(**inputs, do_sample=False)
    greedy = model.generate(**inputs, do_sample=False, **speculative)
    sampled = {}
    for backend in ("triton", "torch"):
        os.environ[BACKEND_ENV_VAR] = backend
        sampled[backend] = model.generate(**inputs, do_sample=True, temperature=0.8, top_k=50, **speculative)
    del os.environ[BACKEND_ENV_VAR]
    result = {
        "backend": rejection_backend(device),
        "greedy_identical": torch.equal(greedy.sequences, plain),
        "greedy_accepted_tokens": greedy.spec_metrics["num_accepted_tokens"],
        "sampled_same_with_both_backends": torch.equal(
            sampled["triton"].sequences, sampled["torch"].sequences
        ),
    }
    print(f"decode loop on CUDA (tiny random Llama, n-gram k=5): {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu-only", action="store_true", help="skip the CPU SmolLM2 part")
    parser.add_argument("--prompts", type=int, default=8, help="HumanEval prompts per arm (CPU part)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="CPU part")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="CPU part")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (CPU part)")
    parser.add_argument("--warmup", type=int, default=3, help="GPU part: untimed calls first")
    parser.add_argument("--repeats", type=int, default=15, help="GPU part: timed calls per configuration")
    parser.add_argument(
        "--gpu-budget-s", type=float, default=240.0, help="GPU part: no new configuration after this"
    )
    parser.add_argument("--out", default="results/bench_rejection.json")
    args = parser.parse_args()

    results: dict = {"args": vars(args)}
    if not args.gpu_only:
        results["cpu"] = cpu_sampler_share(args)
    if torch.cuda.is_available():
        results["gpu_decode_loop"] = gpu_decode_loop_check(torch.device("cuda"))
        results["gpu"] = gpu_kernels_vs_reference(args)
        results["gpu_sampling_parameters"] = gpu_sampling_parameters_cost(args)
    elif args.gpu_only:
        raise SystemExit("--gpu-only needs a CUDA device")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
