"""The request's processors at every verified position, as a sampled speculative step runs them on a CPU.

A sampled step runs the request's processors at each of a row's k + 1 verified positions. With
Qwen2.5's generation config (repetition penalty 1.1, temperature 0.7, top-k 20, top-p 0.8) this times
`process_logits` over random logits of each vocabulary size, rows at different lengths, two ways in
turn (the order alternating), both giving the same scores (checked):

- `now`: top-p over each row's finite scores (`sampling/top_p.py`);
- `before`: transformers' whole-row top-p (what the loop ran before).

    python benchmarks/bench_processors.py --vocabs 49152 151936 262144 --out benchmarks/bench_processors.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_specdec.sampling.logits_processing import process_logits

ARMS = ("now", "before")


class WholeRowTopP(TopPLogitsWarper):
    """transformers' warper, which `process_logits` leaves to run over the whole row (it takes only that type)."""


def processors(arm: str) -> LogitsProcessorList:
    top_p = (WholeRowTopP if arm == "before" else TopPLogitsWarper)(0.8)
    return LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.1), TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), top_p])


def time_case(vocab: int, rows: int, k: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    positions = rows * (k + 1)
    logits = torch.randn(positions, vocab, generator=generator) * 3
    token_buffer = torch.randint(0, vocab, (rows, 600), generator=generator)
    buffer_rows = np.repeat(np.arange(rows), k + 1)
    # rows at different lengths, as in a batch whose rows accepted different numbers of drafts
    prefix_lens = np.tile(np.arange(400, 401 + k), rows) + np.repeat(np.arange(rows) * 3, k + 1)
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    results = {}
    for repeat in range(repeats + 1):
        for arm in ARMS if repeat % 2 else ARMS[::-1]:
            started = time.perf_counter()
            results[arm] = process_logits(processors(arm), logits, token_buffer, buffer_rows, prefix_lens)
            if repeat:  # the first round warms up
                seconds[arm].append(time.perf_counter() - started)
    if not torch.equal(results["now"], results["before"]):
        raise AssertionError(f"vocab {vocab}, {rows} rows, k={k}: the two ways gave different scores")
    case = {"vocab": vocab, "rows": rows, "k": k, "positions": positions}
    case.update({f"{arm}_ms": 1000 * statistics.median(seconds[arm]) for arm in ARMS})
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[49_152, 151_936])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    cases = []
    print("vocab    rows  k  positions  now ms  before ms  before / now")
    for vocab in args.vocabs:
        for rows in args.rows:
            for k in args.ks:
                case = time_case(vocab, rows, k, args.repeats)
                cases.append(case)
                print(
                    f"{vocab:<8} {rows:>4} {k:>2} {case['positions']:>10} {case['now_ms']:>7.1f} {case['before_ms']:>10.1f}"
                    f"  {case['before_ms'] / case['now_ms']:.2f}x"
                )
    if args.out:
        machine = {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
        with open(args.out, "w") as handle:
            json.dump({"machine": machine, "torch": torch.__version__, "repeats": args.repeats, "cases": cases}, handle, indent=1)


if __name__ == "__main__":
    main()
