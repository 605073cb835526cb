"""What running on the model's own attention and cache costs (`cache/own_attention.py`): SmolLM2-135M-Instruct
forced onto that path (batched on one `DynamicCache`, and one row per forward) against the same model on the
paged cache, and plain `generate()`.

BLOOM, GPT-Neo, MPT and the other families that run on their own attention ship no small real checkpoint
to these machines, so the cost is measured where the paged path also runs: the one real model here.
Arms, interleaved per batch in one process (order rotated each repeat), fp32, greedy, the n-gram drafter
(k=4, lookup 2..4), our CPU linears in every speculative arm and in a second plain arm: plain `generate()`,
plain with the same CPU linears, ours paged, ours on its own attention batched (BLOOM, GPT-Neo, MPT...), and
one row per forward (models with sliding or recurrent layers on their own attention). Batches of `--batch-sizes`
MT-bench / HumanEval prompts (left-padded), `--max-new-tokens` each; medians of tokens per second over
`--repeats`. Each of ours must give plain `generate()`'s tokens (checked, reported).

    python benchmarks/bench_own_attention.py --out benchmarks/bench_own_attention.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

import hf_specdec
from hf_specdec.bench.runner import interleaved_seconds
from hf_specdec.cache.architectures import check_architecture
from hf_specdec.cache.own_attention import mark_own_attention
from hf_specdec.models.cpu_linear import _cpu_name, fast_cpu_linears
from hf_specdec.models.real_models import humaneval_prompts, load_smollm2, mtbench_prompts

CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


OURS = ("ours, paged", "ours, own attention batched", "ours, own attention per row")


def make_arms(paged, batched, per_row, batch: dict, max_new_tokens: int) -> dict:
    """The five arms on `batch`, each a function returning its sequences."""
    options = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)

    def plain(fast: bool):
        with torch.no_grad(), fast_cpu_linears(paged) if fast else torch.no_grad():
            return paged.generate(**batch, **options)

    return {
        "plain": lambda: plain(False),
        "plain, same CPU linears": lambda: plain(True),
        "ours, paged": lambda: paged.generate(**batch, **options, speculative_config=CONFIG),
        "ours, own attention batched": lambda: batched.generate(**batch, **options, speculative_config=CONFIG),
        "ours, own attention per row": lambda: per_row.generate(**batch, **options, speculative_config=CONFIG),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    paged, tokenizer = load_smollm2()
    batched, per_row = load_smollm2()[0], load_smollm2()[0]
    for model in (paged, batched, per_row):
        check_architecture(model)  # the verdict first: it runs once per model, and would mark the model anew
        hf_specdec.enable(model)
    # as check_architecture marks a model the paged attention cannot run (its layers all plain DynamicLayers,
    # or, as where sliding or recurrent layers hold the rows' caches, one row per forward)
    mark_own_attention(batched, batched=True)
    mark_own_attention(per_row)
    results = []
    for prompts_name, prompts in (("mt-bench", mtbench_prompts(tokenizer)), ("humaneval", humaneval_prompts(tokenizer))):
        for batch_size in args.batch_sizes:
            batch = tokenizer(prompts[:batch_size], return_tensors="pt", padding=True)
            new_tokens = args.max_new_tokens * batch_size
            arms = make_arms(paged, batched, per_row, batch, args.max_new_tokens)
            outputs = {name: arm() for name, arm in arms.items()}  # warm-up (plans, verdicts), and the tokens
            seconds = interleaved_seconds(arms, args.repeats)
            medians = {name: statistics.median(s) for name, s in seconds.items()}
            row = {
                "prompts": prompts_name,
                "batch_size": batch_size,
                "tokens_per_second": {name: new_tokens / s for name, s in medians.items()},
                "seconds": seconds,
                "identical_to_plain": {name: bool(torch.equal(outputs[name], outputs["plain"])) for name in OURS},
            }
            tps = row["tokens_per_second"]
            print(
                f"{prompts_name} batch {batch_size}: "
                + ", ".join(f"{name} {value:.1f} tok/s" for name, value in tps.items())
                + "; x plain (x same linears): "
                + ", ".join(f"{n} {tps[n] / tps['plain']:.2f}x ({tps[n] / tps['plain, same CPU linears']:.2f}x)" for n in OURS)
                + f"; identical {row['identical_to_plain']}",
                flush=True,
            )
            results.append(row)
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"machine": _cpu_name(), "python": platform.python_version(), "config": CONFIG, "args": vars(args),
                       "results": results}, file, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
