"""Layer-skip self-speculation on SmolLM2-135M-Instruct (30 layers), batch 1, greedy.

    python benchmarks/bench_layer_skip.py                        # HumanEval[:6] + MT-bench[:6], N = 4, 8, 12
    python benchmarks/bench_layer_skip.py --sets humaneval:2 --exit-layers 8 --max-new-tokens 64

Arms, interleaved per prompt in one process (the order rotates from prompt to prompt, so machine
noise hits them alike): plain greedy `generate()`; ours, `speculative_config={"method":
"layer_skip", "early_exit_layer": N}`; transformers' own `generate(assistant_early_exit=N)`.
Reported per prompt set: median tokens/s per arm and its ratio to plain, tau (1 + accepted drafts
per drafting step) for both speculative arms, and how many outputs are token-identical to plain.
transformers' tau is counted from the `num_matches` its candidate generator is told each step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers.generation import candidate_generator

import hf_specdec
from hf_specdec.models.real_models import humaneval_prompts, load_smollm2, mtbench_prompts

PROMPT_SETS = {"humaneval": humaneval_prompts, "mt-bench": mtbench_prompts}


class MatchCounter:
    """Counts transformers' assisted-generation steps and accepted candidates (`num_matches`)."""

    def __init__(self):
        self.steps = self.matches = 0
        self._original = candidate_generator.AssistedCandidateGenerator.update_candidate_strategy
        counter = self

        def counting(generator, input_ids, scores, num_matches):
            counter.steps += 1
            counter.matches += int(num_matches)
            return counter._original(generator, input_ids, scores, num_matches)

        candidate_generator.AssistedCandidateGenerator.update_candidate_strategy = counting

    def reset(self) -> None:
        self.steps = self.matches = 0

    @property
    def tau(self) -> float:
        return 1 + self.matches / max(self.steps, 1)


def new_token_count(sequences: torch.Tensor, prompt_width: int, eos_token_id: int) -> int:
    row = sequences[0, prompt_width:].tolist()
    return row.index(eos_token_id) + 1 if eos_token_id in row else len(row)


def run_set(model, tokenizer, name: str, limit: int, args, counter: MatchCounter) -> dict:
    prompts = PROMPT_SETS[name](tokenizer, limit=limit)
    arms: dict[str, dict] = {"plain": {}}
    for n in args.exit_layers:
        config = {"method": "layer_skip", "early_exit_layer": n, "num_speculative_tokens": args.k}
        arms[f"ours_N{n}"] = {"speculative_config": config, "return_dict_in_generate": True}
        arms[f"hf_early_exit_N{n}"] = {"assistant_early_exit": n}
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    taus: dict[str, list[float]] = {arm: [] for arm in arms if arm != "plain"}
    identical = {arm: 0 for arm in arms if arm != "plain"}
    names = list(arms)
    for index, prompt in enumerate(prompts):
        inputs = tokenizer([prompt], return_tensors="pt")
        width = inputs.input_ids.shape[1]
        shift = index % len(names)
        outputs = {}
        for arm in names[shift:] + names[:shift]:
            counter.reset()
            start = time.perf_counter()
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **arms[arm])
            seconds = time.perf_counter() - start
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            outputs[arm] = sequences
            rates[arm].append(new_token_count(sequences, width, tokenizer.eos_token_id) / seconds)
            if arm.startswith("ours"):
                taus[arm].append(out.spec_metrics["mean_acceptance_length"])
            elif arm.startswith("hf"):
                taus[arm].append(counter.tau)
        for arm in identical:
            identical[arm] += int(torch.equal(outputs[arm], outputs["plain"]))
        print(
            f"  {name} {index + 1}/{len(prompts)}: "
            + ", ".join(
                f"{arm} {rates[arm][-1]:.1f} tok/s" + (f" tau {taus[arm][-1]:.2f}" if arm in taus else "")
                for arm in names
            ),
            flush=True,
        )
    plain = statistics.median(rates["plain"])
    return {
        "set": name,
        "num_prompts": len(prompts),
        "median_tokens_per_s": {arm: statistics.median(v) for arm, v in rates.items()},
        "median_speed_vs_plain": {
            arm: statistics.median(v) / plain for arm, v in rates.items() if arm != "plain"
        },
        "median_tau": {arm: statistics.median(v) for arm, v in taus.items()},
        "identical_to_plain": {arm: f"{count}/{len(prompts)}" for arm, count in identical.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sets", default="humaneval:6,mt-bench:6", help="name:count,... (humaneval, mt-bench)"
    )
    parser.add_argument("--exit-layers", type=int, nargs="+", default=[4, 8, 12])
    parser.add_argument("--k", type=int, default=4, help="our num_speculative_tokens")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    parser.add_argument("--out", default="results/bench_layer_skip.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    hf_specdec.enable(model)
    counter = MatchCounter()
    results = {"args": vars(args), "runs": []}
    for spec in args.sets.split(","):
        name, count = spec.split(":")
        run = run_set(model, tokenizer, name, int(count), args, counter)
        results["runs"].append(run)
        print(json.dumps(run, indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
