"""Tree drafting against the chain on SmolLM2-135M-Instruct with our EAGLE-3 head (issue #35's figures).

Per prompt set (MT-bench and HumanEval first turns, chat template; the first --num-prompts of
each), greedy, arms interleaved per batch (`hf_specdec.bench.run_benchmark`; at batch 1 a batch is
one prompt):

- batch 1: plain generate(), plain with the same CPU linears ours runs, ours drafting a chain of
  k = --k (default 5) and ours drafting an EAGLE-2 dynamic tree of each --tree-nodes size (default
  8, 16, 32, 64), for every --topks x --depths combination (default topk 4, depth 5: a tree's depth
  is its num_speculative_tokens, so the default trees reach as deep as the chain);
- each larger batch size (--batch-sizes, default 1,8): plain, plain with the same linears, the
  chain, and the tree with the best batch-1 speed on that set (the highest median per-prompt ratio
  to plain generate()), or --large-batch-tree.

Per arm: tau, mean tree size (draft tokens per drafted row-step), the accepted-length histogram,
tokens/s, x plain and x plain with the same linears (medians of per-batch ratios: per-prompt at
batch 1), rows identical to plain, and the verify cost (a target forward over N + 1 tokens per row
against a 1-token forward, at that batch size, timed on the run's first batch: `bench/verify_cost.py`).

    python benchmarks/bench_trees.py --out results/trees_cpu.json
    python benchmarks/bench_trees.py --sets humaneval --batch-sizes 1 --out results/trees_cpu.json  # in parts

Runs already in --out with the same settings are kept and skipped (--fresh: run them again, replacing
them; other runs in the file stay), so a long measurement can be run in parts, or resumed; the JSON
is rewritten after every (set, batch size) run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time
from pathlib import Path

import torch

from hf_specdec.bench import BenchSettings, load_prompts, run_benchmark
from hf_specdec.bench.arms import tree_arm_names
from hf_specdec.loop.integration import enable
from hf_specdec.models.real_models import load_smollm2

HEAD = Path(__file__).resolve().parent.parent / "model_cards" / "SmolLM2-135M-Instruct-eagle3"
SETS = ("mt-bench", "humaneval")
ARM_FIELDS = (
    "k", "tree", "tau", "mean_tree_size", "accepted_length_histogram", "accepted_length_counts", "tokens_per_s",
    "ratio_vs_plain", "ratio_vs_plain_fast_linears", "identical_rows", "rows", "verify_cost",
)  # fmt: skip


def int_list(flag: str):
    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{flag}={text!r}: allowed: integers >= 1 separated by commas")
        return list(dict.fromkeys(values))

    return parse


def set_list(text: str) -> list[str]:
    sets = list(dict.fromkeys(text.split(",")))
    unknown = [name for name in sets if name not in SETS]
    if unknown:
        raise argparse.ArgumentTypeError(f"--sets={text!r}: {unknown} unknown; allowed: {', '.join(SETS)}")
    return sets


def tree_json(text: str) -> dict:
    try:
        tree = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"--large-batch-tree={text!r} is not valid JSON ({error})") from None
    if not isinstance(tree, dict):
        raise argparse.ArgumentTypeError(f"--large-batch-tree={text!r}: allowed: a JSON object, e.g. '{{\"num_nodes\": 16}}'")
    return tree


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", default=str(HEAD), help="the EAGLE head (default: our SmolLM2 EAGLE-3 head)")
    parser.add_argument("--method", default="eagle3", choices=("eagle", "eagle3"))
    parser.add_argument("--sets", type=set_list, default=list(SETS), help="mt-bench,humaneval (default both)")
    parser.add_argument("--num-prompts", type=int, default=20, help="the first N prompts of each set (default 20)")
    parser.add_argument("--batch-sizes", type=int_list("--batch-sizes"), default=[1, 8])
    parser.add_argument("--k", type=int, default=5, help="the chain's num_speculative_tokens (default 5)")
    parser.add_argument("--tree-nodes", type=int_list("--tree-nodes"), default=[8, 16, 32, 64])
    parser.add_argument("--topks", type=int_list("--topks"), default=[4], help="children per expanded node (default 4)")
    parser.add_argument("--depths", type=int_list("--depths"), default=[5], help="tree depths (default 5)")
    parser.add_argument(
        "--large-batch-tree",
        type=tree_json,
        help='the tree of the batch sizes > 1 (default: the best of batch 1 on that set), e.g. \'{"num_nodes": 16, "topk": 4, "depth": 5}\'',
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, help="torch CPU threads (the measurements so far: 2 on 2 cores)")
    parser.add_argument("--verify-repeats", type=int, default=5)
    parser.add_argument("--out", help="write the results as JSON here (and resume from it)")
    parser.add_argument(
        "--fresh", action="store_true", help="run again (and replace) the runs asked for that --out already holds"
    )
    args = parser.parse_args(argv)
    if min(args.k, args.num_prompts, args.max_new_tokens) < 1 or args.verify_repeats < 0:
        parser.error("--k, --num-prompts and --max-new-tokens: allowed: integers >= 1; --verify-repeats: >= 0")
    return args


def batch1_trees(args: argparse.Namespace) -> list[dict]:
    return [
        {"num_nodes": nodes, "topk": topk, "depth": depth}
        for depth, topk, nodes in itertools.product(args.depths, args.topks, args.tree_nodes)
    ]


def run_key(args: argparse.Namespace, prompt_set: str, batch_size: int, trees: list[dict]) -> dict:
    """What a run's figures depend on: an earlier run with the same key is reused, not run again."""
    return {
        "set": prompt_set, "batch_size": batch_size, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
        "head": os.path.abspath(args.head), "method": args.method, "k": args.k, "trees": trees,
        "threads": torch.get_num_threads(),
    }  # fmt: skip


def best_tree(run: dict) -> dict:
    """The tree arm of a batch-1 run with the highest median per-prompt ratio to plain generate()."""
    trees = {name: arm for name, arm in run["arms"].items() if arm.get("tree") is not None and name != "ours"}
    name = max(trees, key=lambda n: trees[n]["ratio_vs_plain"])
    return {key: trees[name]["tree"][key] for key in ("num_nodes", "topk", "depth")}


def compact(results: dict) -> dict:
    return {name: {key: arm.get(key) for key in ARM_FIELDS} for name, arm in results["arms"].items()}


def print_run(entry: dict) -> None:
    key = entry["key"]
    load = entry["load_average"]
    print(
        f"\n{key['set']}, batch {key['batch_size']}, {entry['num_prompts']} prompts, {key['max_new_tokens']} new "
        f"tokens, {entry['seconds']:.0f} s, load average {load[0][0]:.2f} -> {load[1][0]:.2f}",
        flush=True,
    )
    columns = ("arm", "k", "tau", "nodes", "tok/s", "x plain", "x same linears", "identical", "verify N", "verify x")
    lines = [columns]
    for name, arm in entry["arms"].items():
        cost = arm["verify_cost"] or {}
        cells = (
            name, arm["k"], arm["tau"] and f"{arm['tau']:.2f}", arm["mean_tree_size"] and f"{arm['mean_tree_size']:.1f}",
            f"{arm['tokens_per_s']:.1f}", f"{arm['ratio_vs_plain']:.2f}",
            arm["ratio_vs_plain_fast_linears"] and f"{arm['ratio_vs_plain_fast_linears']:.2f}",
            None if name == "plain" else f"{arm['identical_rows']}/{arm['rows']}", cost.get("nodes"),
            cost.get("ratio") and f"{cost['ratio']:.2f}",
        )  # fmt: skip
        lines.append(tuple("" if cell is None else str(cell) for cell in cells))
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    for line in lines:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
    for name, arm in entry["arms"].items():
        if arm["accepted_length_histogram"]:
            print(f"{name}: accepted 0, 1, 2, ...: " + " ".join(f"{p:.2f}" for p in arm["accepted_length_histogram"]))
    print(flush=True)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict = {"runs": []}
    if args.out and Path(args.out).is_file():  # kept; with --fresh, the runs asked for are run again and replaced
        results = json.loads(Path(args.out).read_text())
        print(f"{args.out} holds {len(results['runs'])} runs: the ones asked for again are "
              f"{'run again' if args.fresh else 'skipped'}", flush=True)
    results["machine"] = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    results["description"] = __doc__.split("\n\n")[0]

    model, tokenizer = load_smollm2()
    enable(model)

    def save() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))

    def find(key: dict) -> dict | None:
        return next((run for run in results["runs"] if run["key"] == key), None)

    for prompt_set in args.sets:
        prompts = load_prompts(prompt_set, tokenizer, limit=args.num_prompts)
        for batch_size in sorted(args.batch_sizes):
            if batch_size == 1:
                trees = batch1_trees(args)
            elif args.large_batch_tree is not None:
                trees = [args.large_batch_tree]
            else:
                first = find(run_key(args, prompt_set, 1, batch1_trees(args)))
                if first is None:
                    raise SystemExit(
                        f"batch {batch_size} on {prompt_set} runs the tree with the best batch-1 speed: run batch 1 "
                        "first (same --out and settings) or give --large-batch-tree"
                    )
                trees = [best_tree(first)]
            key = run_key(args, prompt_set, batch_size, trees)
            if find(key) is not None and not args.fresh:
                print(f"{prompt_set}, batch {batch_size}: in {args.out} already, skipped", flush=True)
                continue
            settings = BenchSettings(
                method=args.method, k=args.k, batch_size=batch_size, max_new_tokens=args.max_new_tokens, draft=args.head,
                plain_fast_linears=True, trees=tuple(trees), verify_repeats=args.verify_repeats,
            )  # fmt: skip
            started, load = time.time(), os.getloadavg()
            bench = run_benchmark(model, tokenizer, prompts, settings, progress=False)
            entry = {
                "key": key, "num_prompts": len(prompts), "seconds": time.time() - started,
                "load_average": [load, os.getloadavg()], "tree_arms": dict(zip(tree_arm_names(trees), trees)),
                "arms": compact(bench), "cpu_linear_plan": bench.get("cpu_linear_plan"),
            }  # fmt: skip
            results["runs"] = [run for run in results["runs"] if run["key"] != key] + [entry]
            save()
            print_run(entry)
    return results


if __name__ == "__main__":
    main()
