"""Chunked prefill (`SpeculativeEngine(prefill_chunk_size=N)`): what a long prompt joining a running
batch costs the requests already decoding, and what chunking costs the long one.

SmolLM2-135M-Instruct on CPU, the n-gram drafter (k=4, lookup 2..4). Four MT-bench first turns
decode (`--max-tokens` each); at step `--join-step` a long prompt joins: `--long-problems` HumanEval
problems in one user message (about 1,500 tokens for 8), asking for `--long-tokens` tokens. Arms:
prefill_chunk_size None (the whole prompt in one step) and each of `--chunks`, interleaved over
`--repeats`, in one process.

Per arm (medians over repeats): the longest step the four decoding requests waited through while
the long prompt was fed, their time per output token (TPOT) p50 / p95 over the whole run, the long
request's time to first token (from its arrival), and the run's wall time. Every arm's outputs are
checked equal to the unchunked arm's (greedy).

    python benchmarks/bench_chunked_prefill.py --out benchmarks/bench_chunked_prefill.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

from hf_specdec import SpeculativeEngine
from hf_specdec.bench.prompts import load_prompts
from hf_specdec.models.real_models import load_target

CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def long_prompt(tokenizer, problems: int) -> list[int]:
    code = "\n\n".join(load_prompts("humaneval", tokenizer, problems))  # rendered chat prompts: take their text
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Here are {problems} coding problems:\n\n{code}\n\nWhich one is the hardest?"}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    return tokenizer(text, add_special_tokens=False).input_ids


def run(engine: SpeculativeEngine, short: list[list[int]], long: list[int], args) -> dict:
    """One run: the short requests from step 0, the long one at `join_step`."""
    greedy = {"max_new_tokens": args.max_tokens, "do_sample": False}
    ids = [engine.add_request(prompt, greedy) for prompt in short]
    emitted: dict[str, list[tuple[float, int]]] = {i: [] for i in ids}  # (time, tokens) per output
    outputs: dict[str, list[int]] = {}
    long_id = long_arrival = long_first = None
    step, stall, started = 0, 0.0, time.perf_counter()
    while engine.has_unfinished() or long_id is None:
        if step == args.join_step:
            long_id, long_arrival = engine.add_request(long, {"max_new_tokens": args.long_tokens, "do_sample": False}), time.perf_counter()
        before = time.perf_counter()
        step_outputs = engine.step()
        now = time.perf_counter()
        if long_id is not None and long_first is None:
            stall = max(stall, now - before)  # a step the decoding requests waited through while the prompt was fed
        for output in step_outputs:
            if output.request_id == long_id and long_first is None:
                long_first = now
            if output.request_id in emitted:
                emitted[output.request_id].append((now, len(output.new_token_ids)))
            if output.finished:
                outputs[output.request_id] = output.token_ids
        step += 1
    tpot = []
    for events in emitted.values():  # each output's wait, spread over the tokens it brought
        for (previous, _), (at, count) in zip(events, events[1:]):
            tpot.extend([(at - previous) / count] * count)
    return {
        "stall_s": stall, "tpot_p50_ms": 1e3 * float(np.percentile(tpot, 50)), "tpot_p95_ms": 1e3 * float(np.percentile(tpot, 95)),
        "long_ttft_s": long_first - long_arrival, "wall_s": time.perf_counter() - started,
        "outputs": [outputs[i] for i in [*ids, long_id]],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--chunks", default="512,256,128")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--long-problems", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=32)
    parser.add_argument("--join-step", type=int, default=8)
    args = parser.parse_args()
    model, tokenizer = load_target("smollm2", torch.float32, "cpu")
    short = [tokenizer(p, add_special_tokens=False).input_ids for p in load_prompts("mt-bench", tokenizer, 4)]
    long = long_prompt(tokenizer, args.long_problems)
    arms = [None, *(int(c) for c in args.chunks.split(","))]
    engines = {arm: SpeculativeEngine(model, CONFIG, max_batch_size=8, tokenizer=tokenizer, prefill_chunk_size=arm) for arm in arms}
    run(engines[None], short, long, args)  # warm-up: the CPU linears' plan, first-call costs
    results: dict = {str(arm): [] for arm in arms}
    for _ in range(args.repeats):
        for arm in arms:
            results[str(arm)].append(run(engines[arm], short, long, args))
    reference = results["None"][0]["outputs"]
    summary = {}
    for arm, runs in results.items():
        summary[arm] = {key: float(np.median([r[key] for r in runs])) for key in runs[0] if key != "outputs"}
        summary[arm]["identical"] = all(r["outputs"] == reference for r in runs)
        print(f"prefill_chunk_size={arm:>5}: longest step while fed {summary[arm]['stall_s']:.2f} s, "
              f"TPOT p50 {summary[arm]['tpot_p50_ms']:.0f} ms p95 {summary[arm]['tpot_p95_ms']:.0f} ms, "
              f"long TTFT {summary[arm]['long_ttft_s']:.2f} s, wall {summary[arm]['wall_s']:.1f} s, "
              f"identical {summary[arm]['identical']}")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({
            "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
            "args": vars(args), "long_prompt_tokens": len(long), "short_prompt_tokens": [len(p) for p in short],
            "summary": summary, "runs": {arm: [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
                                         for arm, runs in results.items()},
        }, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
