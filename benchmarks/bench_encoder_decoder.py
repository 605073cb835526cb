"""What speculation costs and gains on encoder-decoder models (`loop/encoder_decoder.py`), at real sizes.

No real encoder-decoder checkpoint reaches these machines (PyPI carries none in Hugging Face format), so the
models are random weights shaped like BART-base (6 + 6 layers, d_model 768, vocabulary 50265), T5-small (6 + 6
layers, d_model 512, vocabulary 32128) and Whisper-base (6 + 6 layers, d_model 512, 80 mel bins): their
acceptance says nothing, their step costs do. Each decoder runs every row in one forward
(`EncoderDecoderBatchedCache`). Two workloads:

- `free`: the model's own greedy output. Arms: plain `generate()`, plain with our CPU linears, ours drafting
  nothing (`disable_by_batch_size: 1`: what the loop itself costs per step, the row's own cache and encoder
  states included), ours with the n-gram drafter (k=4, lookup 1..3), and for a batched decoder at batch > 1
  the same one row per forward (what it cost before it was batched).
- `copy` (BART and T5, whose encoders read the decoder's vocabulary): a logits processor makes the decoder copy its source (a summary quoting its text, the
  case the n-gram lookup of the source is for), in every arm alike; ours drafts from the source.

Interleaved per batch in one process (order rotated each repeat), fp32, greedy, `--max-new-tokens` each,
medians over `--repeats`; every arm of ours must give plain `generate()`'s tokens (checked, reported).

`--engine-requests N` adds the serving case (`SpeculativeEngine`, BART and T5, `copy`): N requests with sources
of different lengths (100-200 tokens) queued at once, `--engine-concurrency` rows at a time, each joining as
another finishes (its source through the encoder as it joins). Arms: the engine speculating with the n-gram
drafter, the same engine drafting nothing, and plain `generate()` over the requests in fixed batches of the
concurrency (each batch padded to its longest source), with torch's linears and with ours. Then, once per
engine arm, with request lengths spread so rows finish apart: the median step in which a request joined against
one in which none did (`step_ms`).

`--engine-burst N` (BART, `free`): N requests with sources of one length (`--burst-source-length` tokens) queued
at once, N rows: they join in one step and the encoder reads their sources in one batch (up to
`engine.BATCHED_PREFILL_LENGTH` positions). Arms: that engine with n-gram drafts, the same engine with each source
through the encoder alone (as before batched admission), plain `generate()` on the N as one batch (torch's
linears, ours); and the first step alone (admission, the encoder, the first decoder step), both ways.

    python benchmarks/bench_encoder_decoder.py --out benchmarks/bench_encoder_decoder.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
import unittest.mock

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    LogitsProcessor,
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

import hf_specdec
from hf_specdec.bench.runner import interleaved_seconds
from hf_specdec.cache.architectures import check_architecture
from hf_specdec.cache.own_attention import mark_own_attention, runs_one_row_per_forward
from hf_specdec.loop import engine as engine_module
from hf_specdec.models.cpu_linear import _cpu_name, fast_cpu_linears

NO_DRAFTS = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 1}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


class CopySource(LogitsProcessor):
    """Row i of the decoder copies `sources[i]`. Its decoder prompt is the start token and the source's first
    token, distinct per row: the loop calls processors with the rows of one prefix length, in no set order, so
    rows are told apart by that token."""

    def __init__(self, sources: torch.Tensor):
        self.sources = sources

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = (input_ids[:, 1:2] == self.sources[None, :, 0]).long().argmax(dim=1)
        forced = torch.full_like(scores, -torch.inf)
        forced[torch.arange(len(rows)), self.sources[rows, min(input_ids.shape[1] - 1, self.sources.shape[1] - 1)]] = 0.0
        return forced


def models() -> dict:
    torch.manual_seed(0)
    bart = BartForConditionalGeneration(BartConfig(forced_eos_token_id=None)).eval()
    whisper = WhisperForConditionalGeneration(WhisperConfig(
        d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
        encoder_ffn_dim=2048, decoder_ffn_dim=2048,
    )).eval()  # fmt: skip
    t5 = T5ForConditionalGeneration(T5Config()).eval()  # (tied embeddings: one vocabulary for encoder and decoder)
    t5.generation_config.decoder_start_token_id = 0  # (T5's checkpoints: the padding id)
    for model in (bart, t5, whisper):
        generation = model.generation_config
        generation.forced_eos_token_id = generation.begin_suppress_tokens = generation.suppress_tokens = None
        generation.eos_token_id = None  # every arm decodes max_new_tokens
        hf_specdec.enable(model)
        check_architecture(model)  # the verdict: one row per forward or batched
    return {"bart-base-shaped": bart, "t5-small-shaped": t5, "whisper-base-shaped": whisper}


def sources(name: str, model, batch_size: int) -> dict:
    generator = torch.Generator().manual_seed(batch_size)
    if name.startswith("whisper"):
        return {"input_features": torch.randn((batch_size, 80, 3000), generator=generator)}
    source = torch.randint(4, model.config.vocab_size, (batch_size, 200), generator=generator)
    source[:, 0] = torch.arange(4, 4 + batch_size)  # distinct first tokens: `CopySource` tells rows apart by them
    return {"input_ids": source}


def arms(model, inputs: dict, options: dict, workload: str) -> dict:
    def plain(fast: bool):
        with torch.no_grad(), fast_cpu_linears(model) if fast else torch.no_grad():
            return model.generate(**inputs, **options)

    out = {"plain": lambda: plain(False), "plain, same CPU linears": lambda: plain(True)}
    if workload == "free":
        out["ours, drafting nothing"] = lambda: model.generate(**inputs, **options, speculative_config=NO_DRAFTS)
    out["ours, n-gram"] = lambda: model.generate(**inputs, **options, speculative_config=NGRAM)
    if not runs_one_row_per_forward(model) and len(next(iter(inputs.values()))) > 1:
        out["ours, n-gram, one row per forward"] = lambda: one_row_per_forward(model, inputs, options)
    return out


def engine_arms(model, requests: list[torch.Tensor], concurrency: int, max_new_tokens: int) -> dict:
    """The serving case: every request queued at once, `concurrency` rows at a time (see the module doc)."""
    start = model.generation_config.decoder_start_token_id
    options = {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "do_sample": False}

    def engine(config) -> list[list[int]]:
        engine = hf_specdec.SpeculativeEngine(model, config, max_batch_size=concurrency)
        ids = [
            engine.add_request([start, int(source[0, 0])], options, model_inputs={"input_ids": source},
                               logits_processor=[CopySource(source)])
            for source in requests
        ]  # fmt: skip
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        return [done[i] for i in ids]

    def plain(fast: bool) -> list[list[int]]:
        out = []
        for first in range(0, len(requests), concurrency):
            batch = requests[first : first + concurrency]
            width = max(source.shape[1] for source in batch)
            ids = torch.cat([torch.nn.functional.pad(s, (0, width - s.shape[1]), value=model.config.pad_token_id) for s in batch])
            mask = torch.cat([torch.nn.functional.pad(torch.ones_like(s), (0, width - s.shape[1])) for s in batch])
            decoder = torch.stack([torch.full((len(batch),), start), ids[:, 0]], 1)
            with torch.no_grad(), fast_cpu_linears(model) if fast else torch.no_grad():
                tokens = model.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder,
                                        logits_processor=[CopySource(ids)], **options)  # fmt: skip
            out.extend(row[2:].tolist() for row in tokens)
        return out

    return {"plain generate(), fixed batches": lambda: plain(False), "the same, same CPU linears": lambda: plain(True),
            "engine, drafting nothing": lambda: engine(None), "engine, n-gram": lambda: engine(NGRAM)}  # fmt: skip


def join_step_ms(model, requests: list[torch.Tensor], concurrency: int, max_new_tokens: int, config) -> dict:
    """Median ms of an engine step in which a request joined a full batch (its encoder, its cross-attention keys)
    and of one in which none did. Requests get lengths from a quarter of `max_new_tokens` to all of it, so rows
    finish apart and join one or two at a time."""
    start = model.generation_config.decoder_start_token_id
    engine = hf_specdec.SpeculativeEngine(model, config, max_batch_size=concurrency)
    for index, source in enumerate(requests):
        length = max_new_tokens // 4 + (index * 7) % (max_new_tokens - max_new_tokens // 4 + 1)
        options = {"max_new_tokens": length, "min_new_tokens": length, "do_sample": False}
        engine.add_request([start, int(source[0, 0])], options, model_inputs={"input_ids": source}, logits_processor=[CopySource(source)])
    with_join, without, seen = [], [], set()
    while engine.has_unfinished():
        began = time.perf_counter()
        new = {output.request_id for output in engine.step()} - seen
        elapsed = round((time.perf_counter() - began) * 1e3, 1)
        if len(seen) >= concurrency:  # (the first requests' steps: the batch filling up)
            (with_join if new else without).append(elapsed)
        seen |= new
    return {
        "with_join": statistics.median(with_join) if with_join else None, "without": statistics.median(without) if without else None,
        "steps": [len(with_join), len(without)],
    }  # fmt: skip


def one_row_per_forward(model, inputs: dict, options: dict) -> torch.Tensor:
    """Ours with n-gram drafts as a decoder that cannot be batched runs (`EncoderDecoderRowCache`): the batched
    decoder's gain, measured on the same model."""
    mark_own_attention(model, batched=False)
    try:
        return model.generate(**inputs, **options, speculative_config=NGRAM)
    finally:
        mark_own_attention(model, batched=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=None, help="a subset of: bart-base-shaped t5-small-shaped whisper-base-shaped")
    parser.add_argument("--engine-requests", type=int, default=0, help="the serving case: this many requests (0: off)")
    parser.add_argument("--engine-concurrency", type=int, default=4)
    parser.add_argument("--only-engine", action="store_true", help="the serving case alone")
    parser.add_argument("--engine-burst", type=int, default=0, help="BART: this many requests joining at once (0: off)")
    parser.add_argument("--burst-source-length", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.engine_burst < 0:
        parser.error(f"--engine-burst must be 0 (off) or more, got {args.engine_burst}")
    if args.burst_source_length < 1:
        parser.error(f"--burst-source-length must be at least 1, got {args.burst_source_length}")
    torch.set_num_threads(2)
    results = []
    if args.engine_requests:
        results += engine_results(args)
    if args.engine_burst:
        results.append(burst_results(models()["bart-base-shaped"], args.engine_burst, args.burst_source_length, args.max_new_tokens, args.repeats))
    for name, model in models().items():
        if args.models and name not in args.models:
            continue
        for workload in () if args.only_engine else ("free",) if name.startswith("whisper") else ("free", "copy"):
            for batch_size in args.batch_sizes:
                inputs = sources(name, model, batch_size)
                options = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
                if workload == "copy":
                    start = model.generation_config.decoder_start_token_id
                    options["decoder_input_ids"] = torch.stack([torch.full((batch_size,), start), inputs["input_ids"][:, 0]], 1)
                    options["logits_processor"] = [CopySource(inputs["input_ids"])]
                runs = arms(model, inputs, options, workload)
                model.__dict__.pop("spec_decode_metrics", None)
                outputs = {arm: run() for arm, run in runs.items()}  # warm-up (verdicts, plans), and the tokens
                tau = model.spec_decode_metrics.mean_acceptance_length  # (the last arm: the n-gram drafter)
                seconds = interleaved_seconds(runs, args.repeats)
                tps = {arm: args.max_new_tokens * batch_size / statistics.median(s) for arm, s in seconds.items()}
                ours = [arm for arm in runs if arm.startswith("ours")]
                row = {
                    "model": name, "workload": workload, "batch_size": batch_size, "tokens_per_second": tps,
                    "x_plain": {arm: tps[arm] / tps["plain"] for arm in ours},
                    "x_plain_same_linears": {arm: tps[arm] / tps["plain, same CPU linears"] for arm in ours},
                    "ngram_tau": tau, "seconds": seconds,
                    "identical_to_plain": {arm: bool(torch.equal(outputs[arm], outputs["plain"])) for arm in ours},
                }  # fmt: skip
                print(
                    f"{name} {workload} batch {batch_size}: "
                    + ", ".join(f"{arm} {row['x_plain'][arm]:.2f}x ({row['x_plain_same_linears'][arm]:.2f}x)" for arm in ours)
                    + f" x plain (x same linears); n-gram tau {tau:.2f}; identical {row['identical_to_plain']}",
                    flush=True,
                )
                results.append(row)
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"machine": _cpu_name(), "python": platform.python_version(), "args": vars(args),
                       "results": results}, file, indent=1)  # fmt: skip


def engine_results(args) -> list[dict]:
    rows = []
    for name, model in models().items():
        if name.startswith("whisper") or (args.models and name not in args.models):
            continue
        generator = torch.Generator().manual_seed(0)
        requests = []
        for index in range(args.engine_requests):
            length = int(torch.randint(100, 201, (1,), generator=generator))
            source = torch.randint(4, model.config.vocab_size, (1, length), generator=generator)
            source[0, 0] = 4 + index  # distinct first tokens (`CopySource`)
            requests.append(source)
        runs = engine_arms(model, requests, args.engine_concurrency, args.max_new_tokens)
        outputs = {arm: run() for arm, run in runs.items()}  # warm-up, and the tokens
        seconds = interleaved_seconds(runs, args.repeats)
        tokens = args.engine_requests * args.max_new_tokens
        tps = {arm: tokens / statistics.median(s) for arm, s in seconds.items()}
        base = "plain generate(), fixed batches"
        row = {
            "model": name, "workload": "engine, copy", "requests": args.engine_requests,
            "concurrency": args.engine_concurrency, "tokens_per_second": tps,
            "x_plain_fixed_batches": {arm: tps[arm] / tps[base] for arm in runs if arm != base},
            "x_plain_fixed_batches_same_linears": {arm: tps[arm] / tps["the same, same CPU linears"] for arm in runs},
            "x_engine_drafting_nothing": tps["engine, n-gram"] / tps["engine, drafting nothing"], "seconds": seconds,
            "identical_to_plain": {arm: outputs[arm] == outputs[base] for arm in runs if arm != base},
            "step_ms": {arm: join_step_ms(model, requests, args.engine_concurrency, args.max_new_tokens, config)
                        for arm, config in (("engine, drafting nothing", None), ("engine, n-gram", NGRAM))},
        }  # fmt: skip
        print(
            f"{name} engine, {args.engine_requests} requests at concurrency {args.engine_concurrency}: "
            + ", ".join(f"{arm} {tps[arm]:.1f} tok/s" for arm in runs)
            + f"; n-gram {row['x_engine_drafting_nothing']:.2f}x the engine drafting nothing; identical {row['identical_to_plain']}; "
            + "; ".join(f"{arm}: a step {t['with_join']} ms with a join, {t['without']} without (medians)" for arm, t in row["step_ms"].items()),
            flush=True,
        )
        rows.append(row)
    return rows


def burst_results(model, count: int, source_length: int, max_new_tokens: int, repeats: int) -> dict:
    """`--engine-burst`: `count` BART requests with sources of one length joining at once (see the module doc)."""
    source = torch.randint(4, model.config.vocab_size, (count, source_length), generator=torch.Generator().manual_seed(count))
    start = [model.generation_config.decoder_start_token_id]
    options = {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "do_sample": False}

    def engine(batched: bool, first_step_only: bool = False) -> list[list[int]]:
        alone = lambda joining, lengths: [[one] for one in joining]  # noqa: E731 - each source through the encoder alone
        with contextlib.ExitStack() as stack:
            if not batched:
                stack.enter_context(unittest.mock.patch.object(engine_module, "_batchable_groups", alone))
            engine = hf_specdec.SpeculativeEngine(model, NGRAM, max_batch_size=count)
            ids = [engine.add_request(start, options, model_inputs={"input_ids": source[i : i + 1]}) for i in range(count)]
            done = {}
            while engine.has_unfinished():
                done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
                if first_step_only:
                    engine.close()
                    return []
        return [done[i] for i in ids]

    def plain(fast: bool) -> list[list[int]]:
        with torch.no_grad(), fast_cpu_linears(model) if fast else torch.no_grad():
            return [row[1:].tolist() for row in model.generate(input_ids=source, **options)]

    runs = {
        "plain generate(), one batch": lambda: plain(False), "the same, same CPU linears": lambda: plain(True),
        "engine, n-gram, sources encoded together": lambda: engine(True),
        "engine, n-gram, each source encoded alone": lambda: engine(False),
        "first step, sources encoded together": lambda: engine(True, first_step_only=True),
        "first step, each source encoded alone": lambda: engine(False, first_step_only=True),
    }  # fmt: skip
    outputs = {arm: run() for arm, run in runs.items()}  # warm-up, and the tokens
    seconds = interleaved_seconds(runs, repeats)
    median = {arm: statistics.median(s) for arm, s in seconds.items()}
    engines = [arm for arm in runs if arm.startswith("engine")]
    row = {
        "model": "bart-base-shaped", "workload": "engine burst, free", "requests": count, "source_length": source_length,
        "max_new_tokens": max_new_tokens,
        "median_seconds": median, "seconds": seconds,
        "x_plain": {arm: median["plain generate(), one batch"] / median[arm] for arm in engines},
        "x_plain_same_linears": {arm: median["the same, same CPU linears"] / median[arm] for arm in engines},
        "identical_to_plain": {arm: outputs[arm] == outputs["plain generate(), one batch"] for arm in engines},
    }  # fmt: skip
    print(
        f"bart-base-shaped, {count} requests of {source_length} source tokens at once: " + ", ".join(f"{arm} {t:.2f} s" for arm, t in median.items())
        + "; " + ", ".join(f"{arm} {row['x_plain'][arm]:.2f}x ({row['x_plain_same_linears'][arm]:.2f}x)" for arm in engines)
        + f" x plain (x same linears); identical {row['identical_to_plain']}",
        flush=True,
    )  # fmt: skip
    return row


if __name__ == "__main__":
    main()
