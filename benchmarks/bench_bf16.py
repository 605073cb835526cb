"""What exactness means in bf16 / fp16: greedy divergence from plain `generate()` (issue 34).

SmolLM2-135M-Instruct, loaded in each dtype asked for; the first N MT-bench first turns and the
first N HumanEval problems (both with the chat template), greedy, `--max-new-tokens` new tokens, at
batch 1 and batch 8. Arms: plain `generate()`, ours with the n-gram drafter and ours with the
committed EAGLE-3 head (`model_cards/SmolLM2-135M-Instruct-eagle3`), both at k=4 by default.

Every arm runs with `output_logits=True`, so each emitted token comes with the raw logits it was
picked from. Per (dtype, batch size, arm), against plain `generate()` at the same batch size:

- rows identical / diverging, and each divergence's first differing position;
- the top-2 gap there *as plain computed it* (plain's own logits at that step, not a re-run), in
  logits and in units of the dtype's spacing (ULP) at plain's top logit; whether ours picked
  plain's second choice;
- the logit noise between the two computations: |plain's top logit - ours'| over the positions
  before the first divergence, where both ran the same prefix (the verify forward over k+1 tokens
  does the same math as plain's one-token forward, in another order and shape).

Baselines: plain at batch 8 against plain at batch 1 (padding and the batch's shape change the
rounding too), and ours at batch 8 against plain at batch 1. Near-tie frequency: the share of
plain's (batch 1) positions whose top-2 gap is at most 1 / 4 ULPs or below 0.25 / 1.0 in logits.
fp32 is the control: ours must be identical to plain at the same batch size (asserted after the
JSON is written).

    python benchmarks/bench_bf16.py --num-prompts 10 --out benchmarks/bench_bf16.json
    python benchmarks/bench_bf16.py --summarize benchmarks/bench_bf16.json   # the markdown table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import time

import torch

import hf_specdec
from hf_specdec.models.real_models import humaneval_prompts, load_smollm2, mtbench_prompts

HEAD = "model_cards/SmolLM2-135M-Instruct-eagle3"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOPK = 5  # logits kept per emitted token: which of plain's top tokens ours took where they part
MANTISSA_BITS = {
    "fp32": 23,
    "bf16": 7,
    "fp16": 10,
}  # explicit fraction bits: one ULP at x is 2^(floor(log2|x|) - bits)


def cpu_name() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    name = fields.get("Model name", "?").strip()
    return f"{name} (family {fields.get('CPU family', '?').strip()} model {fields.get('Model', '?').strip()})"


def ulp(value: float, dtype: str) -> float:
    return 2.0 ** (math.floor(math.log2(abs(value))) - MANTISSA_BITS[dtype]) if value else 0.0


def run_arm(model, tokenizer, prompts: list[str], batch_size: int, kwargs: dict, max_new_tokens: int) -> dict:
    """Each row's new tokens (to its EOS), with the top-2 values and ids of the logits that picked them."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    rows, seconds, tau = [], 0.0, []
    for start in range(0, len(prompts), batch_size):
        inputs = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True)
        began = time.perf_counter()
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
            return_dict_in_generate=True, output_logits=True, **kwargs,
        )  # fmt: skip
        seconds += time.perf_counter() - began
        metrics = getattr(out, "spec_metrics", None)
        if metrics is not None:
            tau.append(metrics["mean_acceptance_length"])
        top = torch.stack(out.logits).float().topk(TOPK, dim=-1)  # [steps, batch, TOPK]
        new = out.sequences[:, inputs["input_ids"].shape[1] :].tolist()
        for b, tokens in enumerate(new):
            end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
            rows.append(
                {
                    "tokens": tokens[:end],
                    "top": top.values[:end, b].tolist(),
                    "top_ids": top.indices[:end, b].tolist(),
                }
            )
    new_tokens = sum(len(r["tokens"]) for r in rows)
    print(
        f"  bs={batch_size} {kwargs.get('speculative_config', {}).get('method', 'plain')}: {seconds:.0f} s",
        flush=True,
    )
    return {"rows": rows, "seconds": seconds, "tokens_per_s": new_tokens / seconds, "tau": tau}


def compare(reference: list[dict], other: list[dict], dtype: str) -> dict:
    """Rows of `other` identical to `reference`; each divergence with `reference`'s logits there: its
    top-2 gap, and its margin over the token `other` took (0: an exact tie, broken the other way)."""
    divergences, noise = [], []
    for index, (ref, got) in enumerate(zip(reference, other)):
        a, b = ref["tokens"], got["tokens"]
        position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if position is None and len(a) != len(b):  # one row stopped early (cannot happen: EOS is a token)
            position = min(len(a), len(b))
        same = len(a) if position is None else position
        noise += [abs(ref["top"][i][0] - got["top"][i][0]) for i in range(same)]
        if position is None:
            continue
        entry = {"row": index, "position": position}
        if position < len(a) and position < len(b):
            values, ids = ref["top"][position], ref["top_ids"][position]
            other_token, unit = b[position], ulp(values[0], dtype)
            margin = values[0] - values[ids.index(other_token)] if other_token in ids else None
            entry |= {
                "plain_token": a[position], "other_token": other_token, "top_logit": values[0],
                "top2_gap": values[0] - values[1], "top2_gap_ulps": (values[0] - values[1]) / unit,
                "margin_over_other": margin, "margin_over_other_ulps": None if margin is None else margin / unit,
                "other_top2_gap": got["top"][position][0] - got["top"][position][1],
            }  # fmt: skip
        divergences.append(entry)
    positions = [d["position"] for d in divergences]
    gaps = [d["top2_gap"] for d in divergences if "top2_gap" in d]
    noise.sort()
    return {
        "rows": len(reference),
        "identical": len(reference) - len(divergences),
        "diverging": len(divergences),
        "first_divergence_mean": statistics.mean(positions) if positions else None,
        "first_divergence_median": statistics.median(positions) if positions else None,
        "top2_gap_mean": statistics.mean(gaps) if gaps else None,
        "top2_gap_median": statistics.median(gaps) if gaps else None,
        "top2_gap_max": max(gaps) if gaps else None,
        "top2_gap_ulps_max": max(d["top2_gap_ulps"] for d in divergences if "top2_gap_ulps" in d)
        if gaps
        else None,
        "other_within_1_ulp_of_plain_top": sum(
            d.get("margin_over_other_ulps") is not None and d["margin_over_other_ulps"] <= 1
            for d in divergences
        ),
        "top_logit_noise_median": noise[len(noise) // 2] if noise else None,
        "top_logit_noise_p99": noise[int(0.99 * (len(noise) - 1))] if noise else None,
        "top_logit_noise_max": noise[-1] if noise else None,
        "top_logit_noise_nonzero": sum(n > 0 for n in noise) / len(noise) if noise else None,
        "divergences": divergences,
    }


def near_ties(rows: list[dict], dtype: str) -> dict:
    """The share of positions where plain's top-2 gap is within a few ULPs / below a few tenths."""
    gaps = [(top[0] - top[1], ulp(top[0], dtype)) for r in rows for top in r["top"]]
    share = lambda test: sum(test(g, u) for g, u in gaps) / len(gaps)  # noqa: E731
    return {
        "positions": len(gaps),
        "exact_tie": share(lambda g, u: g == 0),
        "within_1_ulp": share(lambda g, u: g <= u),
        "within_4_ulps": share(lambda g, u: g <= 4 * u),
        "below_0.25": share(lambda g, u: g < 0.25),
        "below_1.0": share(lambda g, u: g < 1.0),
    }


def summary_table(results: dict) -> str:
    """A markdown table per (dtype, comparison), both prompt sets pooled."""
    lines = [
        "| dtype | arm | against | identical rows | first divergence: mean / median position | plain's top-2 gap "
        "there: median / max | of them <= 1 ULP | exact ties | the other's token within 1 ULP of plain's pick "
        "(plain's logits) | top-logit noise before it: median / p99 (worst set) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for dtype in dict.fromkeys(run["dtype"] for run in results["runs"]):
        runs = [run for run in results["runs"] if run["dtype"] == dtype]
        for key in ("vs_plain_same_batch", "vs_plain_bs1"):
            against = "plain, same batch" if key == "vs_plain_same_batch" else "plain, batch 1"
            for arm in runs[0][key]:
                parts = [run[key][arm] for run in runs]
                divergences = [d for c in parts for d in c["divergences"]]
                rows = sum(c["rows"] for c in parts)
                positions = [d["position"] for d in divergences]
                gapped = [d for d in divergences if "top2_gap" in d]
                gaps = [d["top2_gap"] for d in gapped]
                close = sum(
                    d["margin_over_other_ulps"] is not None and d["margin_over_other_ulps"] <= 1
                    for d in gapped
                )
                cells = (
                    [
                        f"{statistics.mean(positions):.1f} / {statistics.median(positions):g}",
                        f"{statistics.median(gaps):.3g} / {max(gaps):.3g}",
                        f"{sum(d['top2_gap_ulps'] <= 1 for d in gapped)}/{len(gapped)}",
                        f"{sum(g == 0 for g in gaps)}/{len(gapped)}",
                        f"{close}/{len(gapped)}",
                    ]
                    if gapped
                    else ["-"] * 5
                )
                noise = (
                    [c["top_logit_noise_median"] for c in parts],
                    [c["top_logit_noise_p99"] for c in parts],
                )
                name = arm.replace("_bs", ", batch ")
                lines.append(
                    f"| {dtype} | {name} | {against} | {rows - len(divergences)}/{rows} | {' | '.join(cells)} | "
                    f"{max(noise[0]):.3g} / {max(noise[1]):.3g} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--num-prompts", type=int, default=20, help="per prompt set")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="ngram's num_speculative_tokens")
    parser.add_argument("--eagle-k", type=int, default=4, help="the EAGLE-3 head's num_speculative_tokens")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="1: on a shared 2-core machine 2 threads ran 9x slower (oversubscribed)",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument(
        "--summarize", metavar="JSON", help="print the markdown table of an earlier run's JSON, run nothing"
    )
    args = parser.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            print(summary_table(json.load(f)))
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    arms = {
        "plain": {},
        "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": args.k}},
        "eagle3": {
            "speculative_config": {"method": "eagle3", "model": HEAD, "num_speculative_tokens": args.eagle_k}
        },
    }
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = {
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__},
        "settings": {
            "num_prompts_per_set": args.num_prompts, "sets": ["mt-bench first turns", "humaneval"],
            "max_new_tokens": args.max_new_tokens, "batch_sizes": batch_sizes, "greedy": True,
            "arms": {name: kw.get("speculative_config") for name, kw in arms.items()},
        },
        "runs": [],
    }  # fmt: skip
    started = time.time()
    for dtype in args.dtypes.split(","):
        model, tokenizer = load_smollm2(dtype=DTYPES[dtype])
        hf_specdec.enable(model)
        sets = {
            "mt-bench": mtbench_prompts(tokenizer, limit=args.num_prompts),
            "humaneval": humaneval_prompts(tokenizer, limit=args.num_prompts),
        }
        warm = tokenizer(sets["mt-bench"][:2], return_tensors="pt", padding=True)
        for kwargs in arms.values():  # one-time costs (numba, the head's loading) out of the timings
            model.generate(
                **warm, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id, **kwargs
            )
        for set_name, prompts in sets.items():
            load = os.getloadavg()
            out = {
                bs: {
                    name: run_arm(model, tokenizer, prompts, bs, kw, args.max_new_tokens)
                    for name, kw in arms.items()
                }
                for bs in batch_sizes
            }
            entry = {
                "dtype": dtype, "set": set_name, "num_prompts": len(prompts), "load_average": [load, os.getloadavg()],
                "tokens_per_s": {f"{name}_bs{bs}": out[bs][name]["tokens_per_s"] for bs in batch_sizes for name in arms},
                "tau": {f"{name}_bs{bs}": statistics.mean(out[bs][name]["tau"]) for bs in batch_sizes for name in arms if name != "plain"},
                "near_ties_plain_bs1": near_ties(out[batch_sizes[0]]["plain"]["rows"], dtype),
                "vs_plain_same_batch": {
                    f"{name}_bs{bs}": compare(out[bs]["plain"]["rows"], out[bs][name]["rows"], dtype)
                    for bs in batch_sizes for name in arms if name != "plain"
                },
                "vs_plain_bs1": {
                    f"{name}_bs{bs}": compare(out[batch_sizes[0]]["plain"]["rows"], out[bs][name]["rows"], dtype)
                    for bs in batch_sizes[1:] for name in arms
                },
            }  # fmt: skip
            results["runs"].append(entry)
            results["seconds"] = time.time() - started
            for label, comparisons in (
                ("vs plain, same batch", entry["vs_plain_same_batch"]),
                ("vs plain bs1", entry["vs_plain_bs1"]),
            ):
                for arm, c in comparisons.items():
                    print(
                        f"{dtype} {set_name:9s} {arm:9s} {label:20s}: identical {c['identical']}/{c['rows']}, first divergence "
                        f"mean {c['first_divergence_mean']} median {c['first_divergence_median']}, top-2 gap median "
                        f"{c['top2_gap_median']} max {c['top2_gap_max']}, noise median {c['top_logit_noise_median']:.3g} "
                        f"p99 {c['top_logit_noise_p99']:.3g}",
                        flush=True,
                    )
            print(
                f"{dtype} {set_name} near ties (plain bs1): {entry['near_ties_plain_bs1']}; {time.time() - started:.0f} s",
                flush=True,
            )
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
            if dtype == "fp32":  # the control, checked once the JSON holds the details
                failed = [arm for arm, c in entry["vs_plain_same_batch"].items() if c["diverging"]]
                assert not failed, f"fp32 control: {failed} diverged from plain generate() on {set_name}"
        del model


if __name__ == "__main__":
    main()
