"""Suffix decoding against the n-gram drafter and plain `generate()` on SmolLM2 (issue 36's figures).

Workloads (greedy, every arm checked token-identical to plain):
- `mt-bench`: the first N MT-bench questions, first turns then second turns; a second turn's chat
  holds the target's own first answer (plain greedy, generated here first);
- `humaneval`: the first N HumanEval problems;
- `repeated`: the same N MT-bench first turns twice in a row (two passes): on the second pass the
  global suffix cache holds every output of the first;
- `bfcl`: the first N BFCL v4 'live multiple' function-calling requests (agentic: tool calls).

Arms, interleaved per batch (`hf_specdec.bench.run_benchmark`): plain, plain with the same CPU
linears, ours with method "suffix" (the model's own global cache, emptied before each workload
and batch size, so nothing leaks between runs) and ours with "ngram" at the same k.

    python benchmarks/bench_suffix.py --out docs/results/suffix_cpu.json

Per workload and batch size: tokens per target forward, tau, x plain, x plain with the same CPU
linears for both drafters, and suffix / ngram tokens per forward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from hf_specdec.bench import BenchSettings, run_benchmark
from hf_specdec.drafters.suffix import MODEL_CACHE_ATTRIBUTE
from hf_specdec.loop.integration import enable
from hf_specdec.models.real_models import bfcl_prompts, humaneval_prompts, load_smollm2, mtbench_questions

ARMS = ("ours", "ours_ngram")


def second_turn_prompts(model, tokenizer, questions: list[dict], max_new_tokens: int) -> list[str]:
    """Each question's two-turn chat, its first answer the target's own (plain greedy, batch 8)."""
    firsts = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
    answers = []
    for start in range(0, len(firsts), 8):
        chats = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in firsts[start : start + 8]]
        inputs = tokenizer(chats, return_tensors="pt", padding=True)
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        answers += tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return [
        tokenizer.apply_chat_template(
            [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": q["turns"][1]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for first, answer, q in zip(firsts, answers, questions)
    ]


def workload_passes(name: str, model, tokenizer, num_prompts: int, max_new_tokens: int) -> list[tuple[str, list[str]]]:
    """(pass name, prompts) in the order they run; passes of one workload share the global cache."""
    chat = lambda text: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    if name == "mt-bench":
        questions = mtbench_questions()[:num_prompts]
        return [("both turns", [chat(q["turns"][0]) for q in questions] + second_turn_prompts(model, tokenizer, questions, max_new_tokens))]
    if name == "humaneval":
        return [("all", humaneval_prompts(tokenizer, limit=num_prompts))]
    if name == "repeated":
        prompts = [chat(q["turns"][0]) for q in mtbench_questions()[:num_prompts]]
        return [("first pass", prompts), ("second pass", prompts)]
    if name == "bfcl":
        return [("all", bfcl_prompts(tokenizer, limit=num_prompts))]
    raise ValueError(f"workload {name!r} is unknown; allowed: mt-bench, humaneval, repeated, bfcl")


def row(results: dict) -> dict:
    arms = results["arms"]
    out = {"identical": {name: arms[name]["identical_fraction"] for name in ARMS}}
    for name in ARMS:
        arm = arms[name]
        out[name] = {
            key: arm[key]
            for key in ("tokens_per_target_forward", "tau", "ratio_vs_plain", "ratio_vs_plain_fast_linears", "tokens_per_s")
        }
    out["suffix_over_ngram_tokens_per_forward"] = (
        arms["ours"]["tokens_per_target_forward"] / arms["ours_ngram"]["tokens_per_target_forward"]
    )
    out["suffix_over_ngram_speed"] = arms["ours"]["tokens_per_s"] / arms["ours_ngram"]["tokens_per_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="mt-bench,humaneval,repeated,bfcl")
    parser.add_argument("--num-prompts", type=int, default=20, help="per workload (repeated: per pass)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    enable(model)
    settings = dict(method="suffix", k=args.k, max_new_tokens=args.max_new_tokens, plain_fast_linears=True, compare_methods=("ngram",))
    results = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "settings": {**settings, "compare_methods": ["ngram"], "num_prompts": args.num_prompts},
        "runs": [],
    }
    for workload in args.workloads.split(","):
        passes = workload_passes(workload, model, tokenizer, args.num_prompts, args.max_new_tokens)
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            setattr(model, MODEL_CACHE_ATTRIBUTE, None)  # a fresh global cache: nothing from other runs
            for pass_name, prompts in passes:
                started, load = time.time(), os.getloadavg()
                result = run_benchmark(model, tokenizer, prompts, BenchSettings(batch_size=batch_size, **settings), progress=False)
                entry = {
                    "workload": workload, "pass": pass_name, "batch_size": batch_size, "num_prompts": len(prompts),
                    "seconds": time.time() - started, "load_average": [load, os.getloadavg()], **row(result),
                }  # fmt: skip
                results["runs"].append(entry)
                suffix, ngram = entry["ours"], entry["ours_ngram"]
                print(
                    f"{workload:9s} {pass_name:11s} bs={batch_size}: tokens/forward suffix {suffix['tokens_per_target_forward']:.2f} "
                    f"ngram {ngram['tokens_per_target_forward']:.2f} ({entry['suffix_over_ngram_tokens_per_forward']:.2f}x); "
                    f"x plain suffix {suffix['ratio_vs_plain']:.2f} ngram {ngram['ratio_vs_plain']:.2f}; "
                    f"x plain same linears suffix {suffix['ratio_vs_plain_fast_linears']:.2f} "
                    f"ngram {ngram['ratio_vs_plain_fast_linears']:.2f}; identical {entry['identical']}",
                    flush=True,
                )
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
