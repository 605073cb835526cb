"""Issue #37's serving figure on one CUDA GPU: `SpeculativeEngine` with requests arriving while others
run, on bench_gpu.py's Llama-3.1-8B-shaped bf16 target (random "decisive" weights, built on the
device: nothing downloaded) and its oracle drafter (alpha 0.8, k 4), against the same engine with
speculation off.

    python benchmarks/bench_serve_gpu.py --out benchmarks/bench_serve_gpu_<gpu>.json
    python benchmarks/bench_serve_gpu.py --cpu-smoke --out X.json   # a tiny fp32 Llama on CPU (< 1 min)

It drives the engine in this process, as the server's engine thread does (no HTTP: the server's own
cost is measured on CPU by bench_serve.py). Per concurrency level c (1, 4, 16): max(waves x c,
--num-requests) requests of `--context` random prompt tokens and `--max-new-tokens` new tokens each;
c are in flight at once and each one that finishes is replaced by the next (a closed loop), so
requests keep joining a running batch. Per arm: throughput (tokens / wall), TTFT (added to first
token) and TPOT ((last - first) / (tokens - 1)) p50 / p95 over the requests; the arms run
interleaved per repeat, medians over repeats (one warm-up run per arm first). Exactness: each
request's tokens against plain greedy `generate()` of its prompt (the oracle proposes those, each
draft replaced by a wrong token with probability 1 - alpha).

The oracle knows requests, not engine slots: `SlotOracle` maps each slot to the request it holds.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu  # noqa: E402  (a sibling script, not a package)

from hf_specdec import SpeculativeEngine  # noqa: E402
from hf_specdec.drafters import DraftProposal, ProposeRequest  # noqa: E402
from hf_specdec.loop.metrics import SpecDecodeMetrics  # noqa: E402


class SlotOracle:
    """bench_gpu's `OracleProposer` for an engine: its rows are the requests' indices, the engine's
    rows are slots; `engine` is bound once the engine exists (it builds its drafter while starting)."""

    def __init__(self, oracle: bench_gpu.OracleProposer):
        self.oracle = oracle
        self.engine: SpeculativeEngine | None = None

    def propose(self, request: ProposeRequest) -> DraftProposal:
        rows = [int(self.engine._running[row].request_id) for row in request.rows]
        return self.oracle.propose(dataclasses.replace(request, rows=rows))

    def release(self, rows: list[int], token_ids: list[np.ndarray] | None = None) -> None:
        pass


def run_once(engine: SpeculativeEngine, prompts: np.ndarray, max_new_tokens: int, concurrency: int) -> dict:
    """Every prompt through the engine, `concurrency` in flight; per request its tokens and times."""
    waiting = collections.deque(range(len(prompts)))
    added, first, last, tokens = {}, {}, {}, {}
    in_flight = 0
    started = time.perf_counter()
    while waiting or engine.has_unfinished():
        while waiting and in_flight < concurrency:
            index = waiting.popleft()
            engine.add_request(prompts[index], {"max_new_tokens": max_new_tokens, "do_sample": False},
                               request_id=str(index))  # fmt: skip
            added[index], in_flight = time.perf_counter(), in_flight + 1
        for output in engine.step():  # the step ends with its host transfer: the tokens are there
            now, index = time.perf_counter(), int(output.request_id)
            if output.new_token_ids:
                first.setdefault(index, now)
                last[index] = now
            if output.finished:
                tokens[index], in_flight = output.token_ids, in_flight - 1
                if output.finish_reason == "error":
                    raise RuntimeError(f"request {index} failed: {output.error}")
    wall = time.perf_counter() - started
    ttft = [first[i] - added[i] for i in tokens]
    tpot = [(last[i] - first[i]) / (len(tokens[i]) - 1) for i in tokens if len(tokens[i]) > 1]
    return {"wall_s": wall, "tokens": tokens, "ttft": ttft, "tpot": tpot,
            "throughput": sum(len(t) for t in tokens.values()) / wall}  # fmt: skip


def summary(runs: list[dict], reference: np.ndarray) -> dict:
    ttft = [t for run in runs for t in run["ttft"]]
    tpot = [t for run in runs for t in run["tpot"]]
    divergent = sum(run["tokens"][i] != reference[i].tolist() for run in runs for i in run["tokens"])
    return {
        "throughput_tokens_per_s": float(np.median([run["throughput"] for run in runs])),
        "throughput_per_repeat": [run["throughput"] for run in runs],
        "ttft_ms_p50": 1e3 * float(np.percentile(ttft, 50)), "ttft_ms_p95": 1e3 * float(np.percentile(ttft, 95)),
        "tpot_ms_p50": 1e3 * float(np.percentile(tpot, 50)), "tpot_ms_p95": 1e3 * float(np.percentile(tpot, 95)),
        "requests": len(ttft), "divergent_from_plain_generate": divergent,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--concurrency", default=None, help="levels, e.g. 1,4,16 (smoke: 1,4)")
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (1024; smoke: 32)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="(128; smoke: 16)")
    parser.add_argument("--alpha", type=float, default=bench_gpu.HEADLINE_ALPHA)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench_serve_gpu.py needs a CUDA device; --cpu-smoke runs the same code on CPU")
    device = torch.device("cpu" if smoke else "cuda")
    levels = [int(c) for c in (args.concurrency or ("1,4" if smoke else "1,4,16")).split(",")]
    context, max_new = args.context or (32 if smoke else 1024), args.max_new_tokens or (16 if smoke else 128)
    shape = bench_gpu.SMOKE_SHAPE if smoke else bench_gpu.LLAMA_8B_SHAPE
    model = bench_gpu.build_target(
        shape, torch.float32 if smoke else torch.bfloat16, device, 0.1 if smoke else 0.005,
        "random" if smoke else "decisive", args.seed,
    )  # fmt: skip
    num_requests = max(args.waves * max(levels), args.num_requests)
    prompts = bench_gpu.random_prompts(num_requests, context, shape["vocab_size"], args.seed, device)
    reference = np.concatenate([  # plain greedy generate(), 16 prompts at a time
        bench_gpu.new_tokens(bench_gpu.timed_generate(model, prompts[i : i + 16], max_new)[1], context)
        for i in range(0, num_requests, 16)
    ])  # fmt: skip
    oracle = SlotOracle(bench_gpu.OracleProposer(reference, context, args.alpha, shape["vocab_size"], args.seed))
    engines = {"off": SpeculativeEngine(model, None, max_batch_size=max(levels), max_model_len=context + max_new + 1)}
    with bench_gpu.oracle_in_loop(oracle):  # the engine builds the oracle as its drafter
        engines["oracle"] = SpeculativeEngine(
            model, bench_gpu.carrier_config(args.k), max_batch_size=max(levels), max_model_len=context + max_new + 1
        )
    oracle.engine = engines["oracle"]
    prompt_rows = prompts.cpu().numpy()
    results = {
        "mode": "cpu-smoke" if smoke else "gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "target": {**shape, "dtype": str(model.dtype)},
        "settings": {"alpha": args.alpha, "k": args.k, "context": context, "max_new_tokens": max_new,
                     "requests_per_run": num_requests, "repeats": args.repeats},
        "levels": {},
    }  # fmt: skip
    for engine in engines.values():  # warm-up: kernels compiled, routes chosen
        run_once(engine, prompt_rows[: max(levels)], 4, max(levels))
    for concurrency in levels:
        engines["oracle"].metrics = SpecDecodeMetrics()  # this level's acceptance
        runs = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                runs[name].append(run_once(engine, prompt_rows, max_new, concurrency))
        level = {name: summary(arm_runs, reference) for name, arm_runs in runs.items()}
        level["throughput_ratio"] = level["oracle"]["throughput_tokens_per_s"] / level["off"]["throughput_tokens_per_s"]
        level["tau"] = engines["oracle"].metrics.to_dict()["mean_acceptance_length"]
        results["levels"][str(concurrency)] = level
        print(f"concurrency {concurrency}: " + json.dumps(level))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
