"""The request's processors, then the random draws and rejection sampling, at every verified position of a
sampled speculative step on a CPU.

A sampled step runs the request's processors at each of a row's k + 1 verified positions, then draws each
row's noise and accepts or rejects its drafts. With Qwen2.5's generation config (repetition penalty 1.1,
temperature 0.7, top-k 20, top-p 0.8) on random logits of each vocabulary size, rows at different
lengths, this times each part two ways in turn (the order alternating), medians:

- processors (`process_logits`), both ways the same scores (checked): `now`, top-p over each row's finite
  scores (`sampling/top_p.py`), temperature and top-k in place and the repetition penalty over its tokens'
  columns (`sampling/in_place.py`); `before`, transformers' processors as they are;
- sampler (`--part sampler`; every row sampled with its own generator, drafts the processed argmax 70% of
  the time): `in_play`, `draw_step_random`'s noise for each row's 64-column blocks in play and the sampler
  over them (`sampling/tokens_in_play.py`); `vocabulary`, noise over the vocabulary and whole rows.

    python benchmarks/bench_processors.py --part both --vocabs 49152 151936 262144 --out benchmarks/bench_processors.json
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
from hf_specdec.sampling.metadata import SpecDecodeMetadata
from hf_specdec.sampling.rejection_sampler import draw_random, draw_step_random, rejection_sample
from hf_specdec.sampling.tokens_in_play import tokens_in_play

PART_ARMS = {"processors": ("now", "before"), "sampler": ("in_play", "vocabulary")}


# subclasses of transformers' processors run as they are: `process_logits` takes its own paths for these exact types
AS_THEY_ARE = {kind: type(f"AsIs{kind.__name__}", (kind,), {}) for kind in (
    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
)}  # fmt: skip


def processors(arm: str) -> LogitsProcessorList:
    """Qwen2.5's: ours (`now`), or transformers' processors as they are (`before`)."""
    kinds = [RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper]
    kinds = [AS_THEY_ARE[kind] for kind in kinds] if arm == "before" else kinds
    return LogitsProcessorList([kind(value) for kind, value in zip(kinds, (1.1, 0.7, 20, 0.8))])


def step_inputs(vocab: int, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Random logits of a step, its rows' tokens, the batch row and prefix length of each position."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows * (k + 1), vocab, generator=generator) * 3
    token_buffer = torch.randint(0, vocab, (rows, 600), generator=generator)
    buffer_rows = np.repeat(np.arange(rows), k + 1)
    # rows at different lengths, as in a batch whose rows accepted different numbers of drafts
    prefix_lens = np.tile(np.arange(400, 401 + k), rows) + np.repeat(np.arange(rows) * 3, k + 1)
    return logits, token_buffer, buffer_rows, prefix_lens


def sampler_step(vocab: int, rows: int, k: int) -> tuple[SpecDecodeMetadata, torch.Tensor]:
    """A step's processed logits and drafts: the processed argmax, else a random token (30%)."""
    processed = process_logits(processors("now"), *step_inputs(vocab, rows, k))
    generator = torch.Generator().manual_seed(1)
    targets = processed.argmax(dim=-1).view(rows, k + 1)[:, :k]
    wrong = torch.rand(rows, k, generator=generator) > 0.7
    drafts = torch.where(wrong, torch.randint(0, vocab, (rows, k), generator=generator), targets)
    return SpecDecodeMetadata.from_drafts(list(drafts.numpy())), processed


def run_sampler(arm: str, metadata: SpecDecodeMetadata, processed: torch.Tensor, seed: int) -> torch.Tensor:
    generators = [torch.Generator().manual_seed(seed + row) for row in range(metadata.num_rows)]
    is_greedy = torch.zeros(metadata.num_rows, dtype=torch.bool)
    if arm == "in_play":  # over the vocabulary where the narrow layout does not pay (few draws)
        draws = draw_step_random(generators, metadata, processed, is_greedy)
    else:
        draws = draw_random(generators, metadata, processed.shape[-1], processed.device)
    return rejection_sample(metadata, processed, is_greedy, draws=draws)[1]


def time_case(part: str, vocab: int, rows: int, k: int, repeats: int) -> dict:
    arms = PART_ARMS[part]
    if part == "processors":
        inputs = step_inputs(vocab, rows, k)
        run = {arm: lambda arm, repeat: process_logits(processors(arm), *inputs) for arm in arms}
    else:
        metadata, processed = sampler_step(vocab, rows, k)
        run = {arm: lambda arm, repeat: run_sampler(arm, metadata, processed, seed=repeat * rows) for arm in arms}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    results = {}
    for repeat in range(repeats + 1):
        for arm in arms if repeat % 2 else arms[::-1]:
            started = time.perf_counter()
            results[arm] = run[arm](arm, repeat)
            if repeat:  # the first round warms up
                seconds[arm].append(time.perf_counter() - started)
    if part == "processors" and not torch.equal(results["now"], results["before"]):
        raise AssertionError(f"vocab {vocab}, {rows} rows, k={k}: the two ways gave different scores")
    case = {"part": part, "vocab": vocab, "rows": rows, "k": k, "positions": rows * (k + 1)}
    if part == "sampler":
        case["in_play_applies"] = tokens_in_play(processed, metadata, torch.ones(rows, dtype=torch.bool)) is not None
    case.update({f"{arm}_ms": 1000 * statistics.median(seconds[arm]) for arm in arms})
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("processors", "sampler", "both"), default="processors")
    parser.add_argument("--vocabs", type=int, nargs="+", default=[49_152, 151_936])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    cases = []
    for part in PART_ARMS if args.part == "both" else [args.part]:
        new, old = PART_ARMS[part]
        print(f"{part}: vocab    rows  k  positions  {new} ms  {old} ms  {old} / {new}")
        for vocab in args.vocabs:
            for rows in args.rows:
                for k in args.ks:
                    case = time_case(part, vocab, rows, k, args.repeats)
                    cases.append(case)
                    print(
                        f"{part}: {vocab:<8} {rows:>4} {k:>2} {case['positions']:>10} {case[f'{new}_ms']:>7.1f}"
                        f" {case[f'{old}_ms']:>7.1f}  {case[f'{old}_ms'] / case[f'{new}_ms']:.2f}x"
                    )
    if args.out:
        machine = {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
        with open(args.out, "w") as handle:
            json.dump({"machine": machine, "torch": torch.__version__, "repeats": args.repeats, "cases": cases}, handle, indent=1)


if __name__ == "__main__":
    main()
