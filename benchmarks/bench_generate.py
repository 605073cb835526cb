"""Plain vs speculative greedy generate() on SmolLM2-135M-Instruct, side by side in one process.

    python benchmarks/bench_generate.py                       # HumanEval[:40] + MT-bench[:80], batch 1 and 8
    python benchmarks/bench_generate.py --sets humaneval:8 --batch-sizes 1
    python benchmarks/bench_generate.py --memory              # KV blocks vs tokens held, peak RSS

The speed runs are `hf-specdec bench --method ngram --plain-fast-linears` (`hf_specdec/bench/`) over
several prompt sets and batch sizes: arms interleaved per batch in alternating order; median
tokens/s, ratio to plain and to plain with the fast CPU linears ours uses (speculation's own
share of the gain, see `hf_specdec/cpu_linear.py`), TTFT / TPOT, tau, acceptance per position, token identity with plain greedy (each
divergence with its top-2 logit gap). `--memory` measures the KV cache and peak RSS on a
mixed-length batch, one fresh process per arm.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

import hf_specdec
from hf_specdec.bench import BenchSettings, format_table, load_prompts, run_benchmark
from hf_specdec.models.real_models import load_smollm2, sharegpt_conversations


def run_set(model, tokenizer, name: str, limit: int, batch_size: int, args) -> dict:
    extra = {"prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    if args.no_match:  # the drafter never proposes: our loop's overhead against plain decoding
        extra["disable_by_batch_size"] = 1
    settings = BenchSettings(
        method="ngram", k=args.k, batch_size=batch_size, max_new_tokens=args.max_new_tokens, extra_config=extra,
        plain_fast_linears=not args.no_plain_fast_linears,
    )
    results = run_benchmark(model, tokenizer, load_prompts(name, tokenizer, limit=limit), settings)
    print(format_table(results), flush=True)
    return {"set": name, **results}


def mixed_length_batch(tokenizer, lengths: list[int]) -> list[str]:
    """Prompts of roughly the given token lengths, cut from ShareGPT conversations."""
    text = " ".join(turn["value"] for record in sharegpt_conversations(limit=400) for turn in record["conversations"])
    ids = tokenizer(text[:200_000]).input_ids
    return [tokenizer.decode(ids[i * 2000 : i * 2000 + n]) for i, n in enumerate(lengths)]


MEMORY_LENGTHS = [100, 2000, 350, 1500, 600, 1200, 800, 150]


def memory_child(mode: str, max_new_tokens: int) -> None:
    """One generate on the mixed-length batch in a fresh process; prints JSON with its peak RSS."""
    torch.set_num_threads(2)
    model, tokenizer = load_smollm2()
    hf_specdec.enable(model)
    inputs = tokenizer(mixed_length_batch(tokenizer, MEMORY_LENGTHS), return_tensors="pt", padding=True)
    extra = {}
    if mode == "ngram":
        extra = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
                                        "prompt_lookup_max": 4}, "return_dict_in_generate": True}
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **extra)
    report = {"mode": mode, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "prompt_tokens": inputs.attention_mask.sum(1).tolist()}
    if mode == "ngram":
        m = out.spec_metrics
        report["kv_peak_blocks_used"] = m["kv_peak_blocks_used"]
        report["kv_blocks_needed_at_peak"] = m["kv_blocks_needed_at_peak"]
        report["kv_ratio"] = m["kv_peak_blocks_used"] / m["kv_blocks_needed_at_peak"]
    print("MEMORY " + json.dumps(report), flush=True)


def memory_report(max_new_tokens: int) -> list[dict]:
    reports = []
    for mode in ("plain", "ngram"):
        proc = subprocess.run(
            [sys.executable, __file__, "--memory-child", mode, "--max-new-tokens", str(max_new_tokens)],
            capture_output=True, text=True, check=True,
        )
        line = next(line for line in proc.stdout.splitlines() if line.startswith("MEMORY "))
        reports.append(json.loads(line[len("MEMORY "):]))
        print(reports[-1], flush=True)
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="humaneval:40,mt-bench:80", help="name:count,... (humaneval, mt-bench)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-match", action="store_true", help="ngram arm drafts nothing (measures overhead)")
    parser.add_argument("--no-plain-fast-linears", action="store_true", help="skip the plain + fast CPU linears arm")
    parser.add_argument("--memory", action="store_true", help="KV usage and peak RSS on a mixed-length batch")
    parser.add_argument("--memory-child", choices=["plain", "ngram"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default="results/bench_generate.json")
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, args.max_new_tokens)
        return
    torch.set_num_threads(args.threads)
    results: dict = {"args": vars(args), "runs": []}
    if args.memory:
        results["memory"] = memory_report(args.max_new_tokens)
    else:
        model, tokenizer = load_smollm2()
        hf_specdec.enable(model)
        for spec in args.sets.split(","):
            name, count = spec.split(":")
            for batch_size in args.batch_sizes:
                results["runs"].append(run_set(model, tokenizer, name, int(count), batch_size, args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
