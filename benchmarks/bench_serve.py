"""Serving figures (issue #37): SmolLM2-135M-Instruct on CPU behind an OpenAI-compatible server,
MT-bench first turns as chat requests, at concurrency 1, 4 and 16.

Arms, each its own server process, started once and kept for the whole run:
- `off`: `hf-specdec serve` with speculation off (the same engine, drafting nothing);
- `ngram`: `hf-specdec serve` with the n-gram lookup (k auto);
- `eagle3-lookup`: `hf-specdec serve` with the committed EAGLE-3 head behind the lookup (k auto);
- `transformers`: `transformers serve --continuous-batching` on the same folder (skipped with a
  reason in the JSON where it does not start).

A run is one arm at one concurrency: `concurrency` client threads each send the next prompt as soon
as their previous request ends (a closed loop), until every prompt is answered: `--waves` prompts per
client at least, so that after the first wave requests arrive while the others run. Streaming chat completions, greedy, `--max-tokens` each. Before the runs every
server answers `--warmup` requests, not counted (a process's first requests load the CPU linears'
plan, and auto k learns its costs: the first repeat ran up to 1.5x slower than the second without
this). Repeats interleave the arms: for each repeat, for each concurrency, every arm in turn.

Per request: TTFT (sent -> first content chunk), TPOT ((last chunk - first chunk) / (tokens - 1)),
completion tokens (the server's usage; retokenized text where a server gives none). Per run:
completion tokens / wall seconds. Reported per arm and concurrency: the median throughput over
repeats, TTFT and TPOT p50 / p95 over every request of every repeat, and whether each answer is the
`off` arm's text (greedy: speculation must not change a token).

    python benchmarks/bench_serve.py --out benchmarks/bench_serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

EAGLE3_HEAD = str(Path(__file__).resolve().parents[1] / "model_cards" / "SmolLM2-135M-Instruct-eagle3")
LOOKUP = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
OURS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": "auto", **LOOKUP},
    "eagle3-lookup": {"method": "eagle3", "model": EAGLE3_HEAD, "num_speculative_tokens": "auto", **LOOKUP},
}
# the KV pool of every server: ours' default (16 rows of 2048 tokens, blocks of 16); transformers serve
# otherwise sizes its pool from free memory (13.5 GB here, which starved the machine)
BLOCK_SIZE, KV_BLOCKS = 16, 16 * 129
START_TIMEOUT = 600.0  # seconds for a server to answer /health (the first start plans the CPU linears)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(arm: str, model_folder: str, threads: int, log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if arm == "transformers":
        command = [
            "transformers", "serve", model_folder, "--continuous-batching", "--device", "cpu", "--dtype", "float32",
            "--port", str(port), "--cb-block-size", str(BLOCK_SIZE), "--cb-num-blocks", str(KV_BLOCKS),
        ]  # fmt: skip
    else:
        command = [sys.executable, "-m", "hf_specdec.cli", "serve", "--model", model_folder, "--port", str(port)]
        if OURS[arm] is not None:
            command += ["--speculative-config", json.dumps(OURS[arm])]
    log = open(log_dir / f"{arm}.log", "w")  # noqa: SIM115 -- kept open for the server's life
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + START_TIMEOUT
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{arm} server exited ({process.returncode}); see {log_dir / f'{arm}.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    raise RuntimeError(f"{arm} server did not answer /health in {START_TIMEOUT:.0f} s")


def chat_request(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming chat completion: timings, text, completion tokens (None where the server gives no usage)."""
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    sent = time.perf_counter()
    chunk_times, pieces, usage = [], [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    chunk_times.append(time.perf_counter())
                    pieces.append(content)
    return {
        "sent": sent, "first": chunk_times[0] if chunk_times else None, "last": chunk_times[-1] if chunk_times else None,
        "text": "".join(pieces), "completion_tokens": (usage or {}).get("completion_tokens"),
    }  # fmt: skip


def run_once(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[float, list[dict]]:
    todo: queue.Queue = queue.Queue()
    for index, prompt in enumerate(prompts):
        todo.put((index, prompt))
    results: list[dict | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            try:
                index, prompt = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[index] = chat_request(url, model, prompt, max_tokens)
            except BaseException as error:  # reported after the run
                errors.append(error)
                return

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return wall, results


def summarize(runs: list[tuple[float, list[dict]]], tokenizer, reference: list[str] | None) -> dict:
    ttft, tpot, throughput, identical, counted_by_usage = [], [], [], [], True
    for wall, results in runs:
        tokens = 0
        for index, result in enumerate(results):
            count = result["completion_tokens"]
            if count is None:
                counted_by_usage = False
                count = len(tokenizer(result["text"], add_special_tokens=False).input_ids)
            tokens += count
            if result["first"] is not None:
                ttft.append(result["first"] - result["sent"])
                if count > 1:
                    tpot.append((result["last"] - result["first"]) / (count - 1))
            if reference is not None:
                identical.append(result["text"] == reference[index])
        throughput.append(tokens / wall)
    return {
        "throughput_tokens_per_s": float(np.median(throughput)),
        "throughput_per_repeat": throughput,
        "ttft_ms_p50": 1e3 * float(np.percentile(ttft, 50)), "ttft_ms_p95": 1e3 * float(np.percentile(ttft, 95)),
        "tpot_ms_p50": 1e3 * float(np.percentile(tpot, 50)), "tpot_ms_p95": 1e3 * float(np.percentile(tpot, 95)),
        "requests": len(ttft), "tokens_counted_by": "usage" if counted_by_usage else "retokenized text",
        "identical_to_off": None if reference is None else f"{sum(identical)}/{len(identical)}",
    }  # fmt: skip


def main() -> None:
    from transformers import AutoTokenizer

    from hf_specdec.models.real_models import mtbench_questions, mtbench_user_turns, smollm2_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--arms", default="off,ngram,eagle3-lookup,transformers")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per run, at least (see --waves)")
    parser.add_argument("--waves", type=int, default=3, help="prompts per client, at least: max(this x c, --num-prompts)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=4, help="requests each server answers before the runs")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads per server")
    args = parser.parse_args()
    arms, levels = args.arms.split(","), [int(c) for c in args.concurrency.split(",")]
    folder = str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    log_dir = Path(args.out).with_suffix(".logs")
    log_dir.mkdir(exist_ok=True)
    servers, skipped = {}, {}
    for arm in arms:
        try:
            servers[arm] = start_server(arm, folder, args.threads, log_dir)
        except RuntimeError as error:
            skipped[arm] = str(error)
    runs: dict[str, dict[int, list]] = {arm: {c: [] for c in levels} for arm in servers}
    try:
        warmup_prompts = mtbench_user_turns(len(mtbench_questions()))[-args.warmup :] if args.warmup else []
        for _, url in servers.values():  # prompts the runs do not use
            run_once(url, folder, warmup_prompts, min(2, len(warmup_prompts)) or 1, args.max_tokens)
        for repeat in range(args.repeats):
            for concurrency in levels:
                prompts = mtbench_user_turns(max(args.waves * concurrency, args.num_prompts))
                for arm, (_, url) in servers.items():
                    wall, results = run_once(url, folder, prompts, concurrency, args.max_tokens)
                    runs[arm][concurrency].append((wall, results))
                    print(f"repeat {repeat} c={concurrency} {arm}: {wall:.1f} s", flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
    figures = {}
    for arm in servers:
        figures[arm] = {}
        for concurrency in levels:
            reference = None
            if "off" in servers and arm != "off":
                reference = [r["text"] for r in runs["off"][concurrency][0][1]]
            figures[arm][str(concurrency)] = summarize(runs[arm][concurrency], tokenizer, reference)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "load": os.getloadavg()},
        "settings": vars(args), "speculative_configs": {a: OURS.get(a) for a in servers}, "skipped": skipped,
        "figures": figures,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for arm, by_level in figures.items():
        for concurrency, f in by_level.items():
            print(
                f"{arm:>14} c={concurrency:>2}: {f['throughput_tokens_per_s']:6.1f} tok/s, TTFT p50/p95 "
                f"{f['ttft_ms_p50']:.0f}/{f['ttft_ms_p95']:.0f} ms, TPOT p50/p95 {f['tpot_ms_p50']:.1f}/"
                f"{f['tpot_ms_p95']:.1f} ms, identical to off: {f['identical_to_off']}"
            )


if __name__ == "__main__":
    main()
