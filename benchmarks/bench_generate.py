"""Plain vs speculative greedy generate() on SmolLM2-135M-Instruct, side by side in one process.

    python benchmarks/bench_generate.py                       # HumanEval[:40] + MT-bench[:80], batch 1 and 8
    python benchmarks/bench_generate.py --sets humaneval:8 --batch-sizes 1
    python benchmarks/bench_generate.py --memory              # KV blocks vs tokens held, peak RSS

For every batch the arms run back to back (plain, ours, transformers' prompt lookup at batch 1),
in an order that alternates between batches, so machine noise hits them alike. Reported: median
tokens/s per arm, the median of the per-batch ratios, tau, acceptance per position, and the share
of rows token-identical to plain greedy; each divergence is reported with the target's top-2
logit gap at the first differing position (only a near-tie may diverge).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

import hf_specdec
from hf_specdec.real_models import humaneval_prompts, load_smollm2, mtbench_prompts, sharegpt_conversations

PROMPT_SETS = {"humaneval": humaneval_prompts, "mt-bench": mtbench_prompts}


def count_new_tokens(sequences: torch.Tensor, prompt_width: int, eos_token_id: int, pad_token_id: int) -> int:
    """New tokens per row up to and including EOS (the padding after it is not work)."""
    total = 0
    for row in sequences[:, prompt_width:].tolist():
        total += row.index(eos_token_id) + 1 if eos_token_id in row else len([t for t in row if t != pad_token_id])
    return total


def top2_gap_at_divergence(model, plain_row: torch.Tensor, spec_row: torch.Tensor, prompt_width: int, num_pad: int):
    """(new-token index, top-2 logit gap of the target there) at the first differing token."""
    position = int((plain_row != spec_row).nonzero()[0])
    prefix = plain_row[num_pad:position]
    with torch.no_grad():
        logits = model(prefix[None]).logits[0, -1].float()
    top2 = logits.topk(2).values
    return position - prompt_width, float(top2[0] - top2[1])


def run_set(model, tokenizer, name: str, limit: int, batch_size: int, args) -> dict:
    prompts = PROMPT_SETS[name](tokenizer, limit=limit)
    config = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    arms = {
        "plain": {},
        "ngram": {"speculative_config": config, "return_dict_in_generate": True},
    }
    if args.no_match:  # the drafter never proposes: our loop's overhead against plain decoding
        config["disable_by_batch_size"] = 1
    elif batch_size == 1:  # transformers' assisted generation raises for batch > 1
        arms["hf_prompt_lookup"] = {
            "prompt_lookup_num_tokens": args.k,
            "max_matching_ngram_size": args.prompt_lookup_max,
        }
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    ratios: dict[str, list[float]] = {arm: [] for arm in arms if arm != "plain"}
    rows = identical = 0
    divergences = []
    metrics = hf_specdec.SpecDecodeMetrics()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    for index, batch in enumerate(batches):
        inputs = tokenizer(batch, return_tensors="pt", padding=True)
        width = inputs.input_ids.shape[1]
        order = list(arms) if index % 2 == 0 else list(reversed(arms))
        outputs, seconds = {}, {}
        for arm in order:
            start = time.perf_counter()
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **arms[arm])
            seconds[arm] = time.perf_counter() - start
            outputs[arm] = out
        spec = outputs["ngram"]
        metrics.merge(hf_specdec.SpecDecodeMetrics(**{
            k: v for k, v in spec.spec_metrics.items() if k not in ("mean_acceptance_length", "draft_acceptance_rate")
        }))
        plain = outputs["plain"]
        for arm in arms:
            sequences = outputs[arm] if isinstance(outputs[arm], torch.Tensor) else outputs[arm].sequences
            rates[arm].append(count_new_tokens(sequences, width, eos, pad) / seconds[arm])
        for arm in ratios:
            ratios[arm].append(rates[arm][-1] / rates["plain"][-1])
        for row in range(len(batch)):
            rows += 1
            if plain.shape == spec.sequences.shape and torch.equal(plain[row], spec.sequences[row]):
                identical += 1
                continue
            width_max = max(plain.shape[1], spec.sequences.shape[1])
            a = torch.nn.functional.pad(plain[row], (0, width_max - plain.shape[1]), value=pad)
            b = torch.nn.functional.pad(spec.sequences[row], (0, width_max - spec.sequences.shape[1]), value=pad)
            if torch.equal(a, b):
                identical += 1
                continue
            num_pad = width - int(inputs.attention_mask[row].sum())
            where = top2_gap_at_divergence(model, a, b, width, num_pad)
            divergences.append({"prompt": index * batch_size + row, "new_token": where[0], "top2_gap": where[1]})
        print(
            f"  {name} bs={batch_size} batch {index + 1}/{len(batches)}: "
            + ", ".join(f"{arm} {rates[arm][-1]:.1f} tok/s" for arm in arms),
            flush=True,
        )
    return {
        "set": name,
        "batch_size": batch_size,
        "num_prompts": len(prompts),
        "median_tokens_per_s": {arm: statistics.median(v) for arm, v in rates.items()},
        "median_ratio_vs_plain": {arm: statistics.median(v) for arm, v in ratios.items()},
        "tau": metrics.mean_acceptance_length,
        "draft_acceptance_rate": metrics.draft_acceptance_rate,
        "accepted_per_position": [
            n / metrics.num_drafts for n in metrics.num_accepted_tokens_per_pos
        ] if metrics.num_drafts else [],
        "tokens_per_target_forward": metrics.num_emitted_tokens / max(metrics.num_target_forwards, 1),
        "identical_fraction": identical / rows,
        "divergences": divergences,
        "time_split_s": {
            "draft": metrics.draft_seconds, "verify": metrics.verify_seconds, "sampler": metrics.sampler_seconds,
            "total": metrics.total_seconds,
        },
    }


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
                run = run_set(model, tokenizer, name, int(count), batch_size, args)
                results["runs"].append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "divergences"}, indent=1), flush=True)
                print(f"  divergences: {run['divergences']}", flush=True)
    from pathlib import Path

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
