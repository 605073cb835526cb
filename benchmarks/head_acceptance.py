"""Simulated greedy acceptance of EAGLE heads on SmolLM2-135M-Instruct's own answers.

    python benchmarks/head_acceptance.py model_cards/SmolLM2-135M-Instruct-eagle3 [more heads ...]
    python benchmarks/head_acceptance.py runs/x/checkpoints/step_60 --architecture runs/x/init-head

The target answers MT-bench and HumanEval first turns greedily (once; cached under `results/`),
then each head is scored on those answers the way the trainer's held-out evaluation scores it
(`DraftTrainingObjective`, `--steps` unrolled draft steps): at each answer position, does the
head's j-th draft equal the target's greedy token, given that drafts 0..j-1 did? With greedy
decoding that is exactly what speculative generate() accepts, so `tau` (1 + mean accepted of a
k = --steps chain) predicts the benchmark's tau without a timing run: a cheap way to compare
checkpoints. Speed still comes from `hf-specdec bench`.

A head is a folder the drafter loads, or a trainer checkpoint (`<output>/checkpoints/step_N`,
whose weights are the training objective's) given with `--architecture <a head folder of the
same shape>`, e.g. the run's `--init-from` head.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from hf_specdec.trainers.data import collate, tokenize_records
from hf_specdec.trainers.objectives import DraftTrainingObjective
from hf_specdec.trainers.regenerate import answer_batch
from hf_specdec.trainers.target_states import run_target
from safetensors.torch import load_file

from hf_specdec.eagle_heads import EagleHead, load_eagle_head
from hf_specdec.real_models import humaneval_user_turns, load_smollm2, mtbench_user_turns

RESULTS = Path(__file__).resolve().parent.parent / "results"
USER_TURNS = {"mt-bench": mtbench_user_turns, "humaneval": humaneval_user_turns}


def parse_sets(text: str) -> list[tuple[str, int]]:
    """"mt-bench:40,humaneval:20" -> [("mt-bench", 40), ("humaneval", 20)]; ValueError naming --sets."""
    sets = []
    for spec in text.split(","):
        name, _, count = spec.partition(":")
        if name not in USER_TURNS or not count.isdigit() or int(count) < 1:
            raise ValueError(
                f"--sets entry {spec!r} is invalid; allowed: name:count with name in {sorted(USER_TURNS)} "
                "and count an integer >= 1"
            )
        sets.append((name, int(count)))
    return sets


def target_answers(model, tokenizer, turns: list[str], max_new_tokens: int, batch_size: int = 16) -> list[dict]:
    """The target's greedy answers to each user turn, in order (truncated answers flagged)."""
    prompts = [[{"role": "user", "content": turn}] for turn in turns]
    return [
        record
        for begin in range(0, len(prompts), batch_size)
        for record in answer_batch(model, tokenizer, prompts[begin : begin + batch_size], max_new_tokens)
    ]


def load_head(source: str, target, architecture: str | None) -> EagleHead:
    if (Path(source) / "config.json").is_file():
        return load_eagle_head(source, target)
    if architecture is None:
        raise ValueError(f"{source!r} has no config.json: pass --architecture <a head folder of the same shape>")
    head = load_eagle_head(architecture, target)
    state = {k.removeprefix("head."): v for k, v in load_file(str(Path(source) / "model.safetensors")).items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    # only what the head borrows from the target may be absent; anything else is the wrong architecture
    missing = [name for name in missing if not name.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {source!r} does not fit --architecture {architecture!r}: missing {missing}, "
            f"unexpected {unexpected}"
        )
    return head


@torch.no_grad()
def simulated_acceptance(head: EagleHead, target, data, steps: int, states: dict) -> dict:
    objective = DraftTrainingObjective(head.eval(), num_steps=steps).eval()
    totals: dict[str, torch.Tensor] = {}
    feature_layers = head.feature_layers_for(len(target.model.layers))
    for begin in range(0, len(data), 4):
        batch = collate(data, list(range(begin, min(begin + 4, len(data)))))
        key = (begin, feature_layers)
        if key not in states:  # the target's features depend only on the layers read: computed once per set
            states[key] = run_target(target, batch.input_ids, feature_layers)
        out = objective(batch.input_ids, batch.loss_mask, states[key], target.get_output_embeddings())
        for key, value in out.items():
            totals[key] = totals.get(key, 0) + value
    return {
        "tau": 1 + float(totals["accepted_len_sum"]) / int(totals["accepted_len_count"]),
        # step j: accepted given drafts 0..j-1 were (the chain's conditional acceptance)
        "acceptance_per_step": (totals["correct"] / totals["counted"].clamp(min=1)).tolist(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("heads", nargs="+")
    parser.add_argument("--architecture", default=None, help="head folder describing trainer checkpoints' shape")
    parser.add_argument("--sets", default="mt-bench:40,humaneval:20", help="name:count, comma-separated")
    parser.add_argument("--steps", type=int, default=3, help="unrolled draft steps (the k of the simulated chain)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("steps", "max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid; allowed: an integer >= 1")
    try:
        sets = parse_sets(args.sets)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    results: dict = {}
    for name, count in sets:
        spec = f"{name}:{count}"
        cached = RESULTS / f"head_acceptance_answers_{name}_{count}_{args.max_new_tokens}.jsonl"
        if not cached.is_file():
            records = target_answers(model, tokenizer, USER_TURNS[name](count), args.max_new_tokens)
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text("".join(json.dumps(r) + "\n" for r in records))
        records = [json.loads(line) for line in cached.read_text().splitlines()]
        data = tokenize_records(records, tokenizer, max_length=2048, min_loss_tokens=1)
        states: dict = {}
        for source in args.heads:
            scored = simulated_acceptance(load_head(source, model, args.architecture), model, data, args.steps, states)
            results.setdefault(source, {})[spec] = scored
            per_step = " ".join(f"{a:.3f}" for a in scored["acceptance_per_step"])
            print(f"{spec:>14}  tau(k={args.steps}) {scored['tau']:.3f}  per step {per_step}  {source}", flush=True)
    return results


if __name__ == "__main__":
    main()
