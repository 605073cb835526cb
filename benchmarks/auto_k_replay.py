"""Auto k replayed on recorded acceptance: how close `num_speculative_tokens="auto"` comes to the best
fixed k, in seconds instead of a timing run's quarter hour.

    python benchmarks/auto_k_replay.py --step-costs 1.138,1.229,1.326,1.43,1.53,1.63,1.73,1.83 --stalls 0.05
    python benchmarks/auto_k_replay.py --sets humaneval:40 --noise 0.15 --out replay.json

Acceptance: SmolLM2's EAGLE-3 head along the target's own greedy answers (`head_acceptance.py`'s
answers and unrolled drafts): at each answer position p, m_p = how many of the head's 8 drafts from
there the target takes. With greedy decoding that is exact: a step at p with k drafts accepts
min(m_p, k) and moves on to p + min(m_p, k) + 1, whatever k the steps before it ran. Computed once per
set and cached under `results/`.

Time: a step with k drafts costs `--step-costs[k - 1]` plain steps (measure them with
`bench_profile.py`: each fixed k's step ms over the plain step's), a plain step 1, each times
log-normal noise (`--noise`, its sigma) and, for a `--stalls` share of the steps, `--stall-factor`
(a CPU VM's hiccups). Each answer, cut to `--max-new-tokens`, is one generate() call; one
`AutoKController` serves them all, as `controller_for` keeps it across calls. The first two steps of a
call are untimed for the controller, as in the loop.

Printed per noise seed: auto's tokens per unit of time over the best fixed k's, pooled and the median
per answer (the bench's batch by batch), and how often auto chose each k. Left out: the prompt's step,
an EAGLE head's catch-up after a plain step (it feeds two positions), and any cost of switching k.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_acceptance import RESULTS, cached_answers, load_head, parse_sets, set_label, simulated_acceptance  # noqa: E402
from hf_specdec.trainers.data import tokenize_records  # noqa: E402

from hf_specdec.loop.auto_k import AutoKController  # noqa: E402
from hf_specdec.models.real_models import load_smollm2  # noqa: E402

EAGLE3_HEAD = Path(__file__).resolve().parents[1] / "model_cards" / "SmolLM2-135M-Instruct-eagle3"
DEPTH = 8  # drafts unrolled per position: the largest k replayed
ANSWER_TOKENS = 256  # the target answers this long (head_acceptance.py's default), cut to --max-new-tokens
# bench_profile's eagle3-b1 on the AMD EPYC of 2026-12-07 (docs/measurements.md): fixed k = 1 / 2 / 3 at
# 116.5 / 125.8 / 135.8 ms a step against 102.4 ms plain, and on from there by the same 0.1 a draft
DEFAULT_STEP_COSTS = "1.138,1.229,1.326,1.43,1.53,1.63,1.73,1.83"


def match_lengths(ranks: torch.Tensor) -> list[int]:
    """[positions, depth] ranks of the target's token among the head's drafts -> drafts accepted from each position."""
    return (ranks == 0).long().cumprod(dim=-1).sum(dim=-1).tolist()


def answer_match_lengths(entry: tuple, max_new_tokens: int) -> list[list[int]]:
    """Per answer of the set, m_p along it (cached under `results/`)."""
    cached = RESULTS / f"auto_k_replay_{set_label(entry).replace(':', '_')}_{max_new_tokens}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    model, tokenizer = load_smollm2()
    head = load_head(str(EAGLE3_HEAD), model, None)
    data = tokenize_records(cached_answers(model, tokenizer, entry, max_new_tokens), tokenizer, max_length=2048, min_loss_tokens=1)
    answers = []
    for i in range(len(data)):
        ranks: list = []
        simulated_acceptance(head, model, data.subset([i]), DEPTH, {}, ranks_out=ranks)
        answers.append(match_lengths(ranks[0]))
    cached.write_text(json.dumps(answers))
    return answers


def replay(answers, policy, step_costs, noise: float, stalls: float, stall_factor: float, seed: int):
    """Per answer (tokens, time in plain steps) with `policy`: a fixed k, or an `AutoKController`; and the ks run."""
    rng = random.Random(seed)
    per_answer, ks = [], []
    for lengths in answers:
        if isinstance(policy, AutoKController):
            policy.begin_batch()
        position, seconds = 0, 0.0
        while position < len(lengths):
            k = policy.next_k(1) if isinstance(policy, AutoKController) else policy
            step = (step_costs[k - 1] if k else 1.0) * math.exp(rng.gauss(0.0, noise))
            step *= stall_factor if rng.random() < stalls else 1.0
            accepted = min(lengths[position], k)
            if isinstance(policy, AutoKController):
                policy.record_step(step, k, [k], [accepted])
            position, seconds = position + accepted + 1, seconds + step
            ks.append(k)
        per_answer.append((len(lengths), seconds))
    return per_answer, ks


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sets", default="mt-bench:80", help="name:count, comma-separated (head_acceptance.py's)")
    parser.add_argument("--step-costs", default=DEFAULT_STEP_COSTS, help="a step's cost at k = 1, 2, ..., in plain steps")
    parser.add_argument("--ks", default="1,2,3,4", help="the fixed ks to compare with")
    parser.add_argument("--noise", type=float, default=0.1, help="sigma of each step time's log-normal noise")
    parser.add_argument("--stalls", type=float, default=0.0, help="the share of steps that stall")
    parser.add_argument("--stall-factor", type=float, default=2.0, help="how much longer a stalled step takes")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128, help=f"tokens per call (2..{ANSWER_TOKENS}: the answers' length)")
    parser.add_argument("--out", default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    try:
        step_costs = [float(cost) for cost in args.step_costs.split(",")]
        fixed_ks = [int(k) for k in args.ks.split(",")]
        sets = parse_sets(args.sets)
    except ValueError as error:
        parser.error(f"{error} (--step-costs: numbers, --ks: integers, comma-separated)")
    if not step_costs or min(step_costs) <= 0 or len(step_costs) > DEPTH:
        parser.error(f"--step-costs {args.step_costs}: allowed: 1 to {DEPTH} costs > 0, one per k = 1, 2, ...")
    if not fixed_ks or not all(1 <= k <= len(step_costs) for k in fixed_ks):
        parser.error(f"--ks {args.ks}: allowed: integers from 1 to {len(step_costs)} (one cost each in --step-costs)")
    if args.noise < 0 or not 0 <= args.stalls <= 1 or args.stall_factor < 1 or args.seeds < 1:
        parser.error("allowed: --noise >= 0, 0 <= --stalls <= 1, --stall-factor >= 1, --seeds >= 1")
    if not 2 <= args.max_new_tokens <= ANSWER_TOKENS:
        parser.error(f"--max-new-tokens={args.max_new_tokens}: allowed: 2 to {ANSWER_TOKENS} (the answers' length)")
    torch.set_num_threads(2)
    answers = [lengths[: args.max_new_tokens] for entry in sets for lengths in answer_match_lengths(entry, ANSWER_TOKENS)]
    runs = []
    for seed in range(args.seeds):
        fixed = {k: replay(answers, k, step_costs, args.noise, args.stalls, args.stall_factor, seed)[0] for k in fixed_ks}
        rate = {k: sum(n for n, _ in v) / sum(t for _, t in v) for k, v in fixed.items()}
        best = max(rate, key=rate.get)
        controller = AutoKController(len(step_costs))
        auto, ks = replay(answers, controller, step_costs, args.noise, args.stalls, args.stall_factor, seed)
        run = {
            "seed": seed, "best_k": best, "fixed_speedup": rate,
            "auto_over_best_pooled": sum(n for n, _ in auto) / sum(t for _, t in auto) / rate[best],
            "auto_over_best_per_answer": statistics.median(
                (n / t) / (fn / ft) for (n, t), (fn, ft) in zip(auto, fixed[best])
            ),
            "k_chosen_counts": [ks.count(k) for k in range(len(step_costs) + 1)],
        }
        runs.append(run)
        print(
            f"seed {seed}: fixed k " + " ".join(f"{k}: {s:.3f}x" for k, s in rate.items())
            + f"; auto / best (k={best}): pooled {run['auto_over_best_pooled']:.3f}, per answer "
            f"{run['auto_over_best_per_answer']:.3f}; auto's ks (0..): {run['k_chosen_counts']}", flush=True,
        )
    summary = {
        "settings": vars(args), "num_answers": len(answers), "runs": runs,
        "auto_over_best_pooled": statistics.mean(r["auto_over_best_pooled"] for r in runs),
        "auto_over_best_per_answer": statistics.mean(r["auto_over_best_per_answer"] for r in runs),
    }
    print(f"mean over seeds: auto / best fixed k pooled {summary['auto_over_best_pooled']:.3f}, "
          f"per answer {summary['auto_over_best_per_answer']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
