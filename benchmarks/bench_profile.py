"""Every drafter against the seed's formula: `hf-specdec bench --profile` over a set of runs.

Each run is one `hf-specdec bench` process (`--profile --plain-fast-linears`, ours at `--k auto` and
at each fixed k of the sweep, interleaved), its JSON kept under `--out` by name, so the set can run
in parts (`--runs pair-b1,pair-b8`) or resume (runs already in `--out` are skipped; `--fresh` redoes
them). `--summarize` prints, per run and arm: ms per decode step by part, c, tokens per row-step,
predicted and measured speedup (x plain with the same CPU linears) and their ratio, and auto k
against the best fixed k: as the ratio of the two arms' medians over batches (each batch's
tokens/s over plain's), and batch by batch (the median of auto's tokens/s over the best k's on
the same batch, which leaves out plain's run-to-run noise and how much the prompts differ).

    python benchmarks/bench_profile.py --out benchmarks/bench_profile.json
    python benchmarks/bench_profile.py --summarize benchmarks/bench_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

EAGLE3_HEAD = str(Path(__file__).resolve().parents[1] / "model_cards" / "SmolLM2-135M-Instruct-eagle3")
PAIR = ["--model", "qwen-coder-1.5b", "--draft", "qwen-coder-0.5b", "--method", "draft_model", "--prompts", "humaneval"]
SMOLLM2 = ["--model", "smollm2"]
LOOKUP = ["--prompt-lookup-min", "2", "--prompt-lookup-max", "4"]

# name -> bench arguments (the common ones are added by `run`)
RUNS = {
    "pair-b1": [*PAIR, "--num-prompts", "4", "--batch-size", "1", "--max-new-tokens", "64", "--ks", "2,4,8"],
    "pair-b8": [*PAIR, "--num-prompts", "8", "--batch-size", "8", "--max-new-tokens", "64", "--ks", "2,4,8"],
    "pair-b8-16": [*PAIR, "--num-prompts", "16", "--batch-size", "8", "--max-new-tokens", "64", "--ks", "2,4,8"],
    "pair-b1-t0.7": [*PAIR, "--num-prompts", "4", "--batch-size", "1", "--max-new-tokens", "64", "--ks", "2,4,8",
                     "--temperature", "0.7"],
    "pair-b8-t0.7": [*PAIR, "--num-prompts", "8", "--batch-size", "8", "--max-new-tokens", "64", "--ks", "2,4,8",
                     "--temperature", "0.7"],
    "ngram-b1": [*SMOLLM2, "--method", "ngram", *LOOKUP, "--prompts", "humaneval", "--num-prompts", "8",
                 "--batch-size", "1", "--max-new-tokens", "128", "--ks", "2,4,8"],
    "ngram-b8": [*SMOLLM2, "--method", "ngram", *LOOKUP, "--prompts", "humaneval", "--num-prompts", "16",
                 "--batch-size", "8", "--max-new-tokens", "128", "--ks", "2,4,8"],
    "eagle3-b1": [*SMOLLM2, "--method", "eagle3", "--draft", EAGLE3_HEAD, "--prompts", "mt-bench", "--num-prompts", "8",
                  "--batch-size", "1", "--max-new-tokens", "128", "--ks", "1,2,3"],
    "eagle3-b8": [*SMOLLM2, "--method", "eagle3", "--draft", EAGLE3_HEAD, "--prompts", "mt-bench", "--num-prompts", "16",
                  "--batch-size", "8", "--max-new-tokens", "128", "--ks", "1,2,3"],
    "eagle3-lookup-b1": [*SMOLLM2, "--method", "eagle3", "--draft", EAGLE3_HEAD, *LOOKUP, "--prompts", "mt-bench",
                         "--num-prompts", "8", "--batch-size", "1", "--max-new-tokens", "128", "--ks", "1,2,3"],
    "eagle3-lookup-b8": [*SMOLLM2, "--method", "eagle3", "--draft", EAGLE3_HEAD, *LOOKUP, "--prompts", "mt-bench",
                         "--num-prompts", "16", "--batch-size", "8", "--max-new-tokens", "128", "--ks", "1,2,3"],
}  # fmt: skip


def run(name: str, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        command = [
            sys.executable, "-m", "hf_specdec.cli", "bench", *RUNS[name], "--k", "auto", "--profile",
            "--plain-fast-linears", "--verify-repeats", "3", "--threads", str(threads), "--no-progress", "--out", str(out),
        ]  # fmt: skip
        subprocess.run(command, check=True)
        return json.loads(out.read_text())


def summarize(results: dict) -> str:
    lines = []
    for name, result in results.items():
        arms = result["arms"]
        lines.append(f"{name} ({result['num_prompts']} prompts, batch {result['settings']['batch_size']}, "
                     f"temperature {result['settings'].get('temperature')}):")  # fmt: skip
        for arm_name, arm in arms.items():
            profile = arm.get("profile")
            if not isinstance(profile, dict) or not profile.get("per_step_ms"):
                continue
            parts = profile["per_step_ms"]
            lines.append(
                f"  {arm_name:8s} k={arm['k']!s:4s} mean k {arm['mean_k_chosen']:.2f}  tau {arm['tau']:.2f}  "
                f"step {parts['total']:.1f} ms = draft {parts['draft_forward']:.1f} + {parts['draft_other']:.1f}, "
                f"verify {parts['verify_forward']:.1f} + {parts['verify_other']:.1f}, processors "
                f"{parts['logits_processing']:.1f}, sampling {parts['sampling']:.1f}, emit {parts['emit']:.1f}, glue "
                f"{parts['glue']:.1f}; plain {profile['plain_step_ms']:.1f} ms  c {profile['c'] or 0:.3f}  "
                f"predicted {profile['predicted_speedup']:.2f}x  measured {profile['measured_speedup']:.2f}x "
                f"(x plain {arm['ratio_vs_plain']:.2f})  ratio {profile['measured_over_predicted']:.2f} (per batch "
                f"{profile.get('measured_over_predicted_per_batch') or 0:.2f}); decode "
                f"{profile.get('decode_speedup') or 0:.2f}x, ratio {profile.get('decode_over_predicted') or 0:.2f}; forward "
                f"bound {profile['forward_bound_speedup']:.2f}x, ratio {profile['measured_over_forward_bound']:.2f}, "
                f"loop {profile['loop_overhead']:.1%} of a plain step, {profile['mean_rows_per_step']:.1f} rows a step"
            )
        fixed = {n: a["ratio_vs_plain_fast_linears"] for n, a in arms.items() if n.startswith("ours_k") or
                 (n == "ours" and a["k"] != "auto")}  # fmt: skip
        if "ours" in arms and arms["ours"]["k"] == "auto" and fixed:
            best = max(fixed, key=fixed.get)
            auto = arms["ours"]["ratio_vs_plain_fast_linears"]
            paired = ""
            if "tokens_per_s_per_batch" in arms["ours"]:  # the two arms on the same batch, back to back
                rates = zip(arms["ours"]["tokens_per_s_per_batch"], arms[best]["tokens_per_s_per_batch"])
                paired = f"; batch by batch (median of auto / {best}): {statistics.median(a / b for a, b in rates):.1%}"
            lines.append(f"  auto k {auto:.2f}x against the best fixed k ({best}) {fixed[best]:.2f}x: "
                         f"{auto / fixed[best]:.1%}{paired}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/bench_profile.json")
    parser.add_argument("--runs", help=f"comma-separated, of: {', '.join(RUNS)} (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fresh", action="store_true", help="redo runs already in --out")
    parser.add_argument("--summarize", metavar="FILE", help="print the table of a finished set and exit")
    args = parser.parse_args()
    if args.summarize:
        print(summarize(json.loads(Path(args.summarize).read_text())))
        return
    names = args.runs.split(",") if args.runs else list(RUNS)
    unknown = [name for name in names if name not in RUNS]
    if unknown:
        parser.error(f"--runs {','.join(unknown)}: allowed: {', '.join(RUNS)}")
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    for name in names:
        if name in results and not args.fresh:
            continue
        results[name] = run(name, args.threads)
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(summarize({name: results[name]}), flush=True)


if __name__ == "__main__":
    main()
