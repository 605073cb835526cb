"""Timed, interleaved runs of every arm, and what they measure.

After one untimed warm-up call per arm, for every batch of prompts the arms run back to back,
in an order reversed from one batch to the next, so machine noise hits them alike. Each arm
runs twice per batch: with max_new_tokens=1 (its time to first token, TTFT: the prompt
forward) and in full. Greedy by default, so every speculative arm must reproduce plain
`generate()`; a row that does not is reported with the target's top-2 logit gap at its first
differing token (only a near-tie may differ, see the README's exactness section). With
`temperature` every arm samples, from the same seed per batch, and rows are not compared.

Per arm: median TTFT, median TPOT ((total - TTFT) / (new tokens of the longest row - 1)),
median tokens/s (every row's new tokens up to EOS), the median over batches of the tokens/s
ratio to plain (and to plain_fast_linears when that arm runs), the share of rows token-identical
to plain, the effective bandwidth (target weight bytes x target forwards per second); for ours
also tau, alpha (the conditional acceptance, `SpecDecodeMetrics.conditional_acceptance_rate`),
acceptance per position, the k chosen and the measured c:

    c = (ours' time per decode step / plain's time per decode step - 1) / drafts per row-step

a decode step's time being (total - TTFT) / (forwards - 1): the draft + verify + sampling of a
step against plain's one-token step (plain_fast_linears' when that arm runs, so that both sides
use the same GEMM), the quantity the closed form and `auto_k` use. (Rows leave
our batch as they finish, plain's stay to the end: at batch > 1, c is an average over sizes.)

For ours also, what its drafts look like and what verifying them costs: the draft tree it drafts
(None: a chain), the mean draft size (tree nodes, or chain drafts, per drafted row-step), the
accepted-length histogram (the share of drafted row-steps that accepted 0, 1, 2, ... drafts) and,
for a fixed k, `verify_cost`: a target forward over its N drafts + 1 tokens per row against a
1-token forward, timed directly on the first batch's prompts before the arms run (`verify_cost.py`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..loop.auto_k import predicted_speedup
from ..loop.metrics import SpecDecodeMetrics
from ..models.cpu_linear import fast_cpu_linears, linear_plan, resolve_backend
from ..profiling import StepProfile, profile_steps
from .arms import Arm, BenchSettings, build_arms, sweep_arm_names
from .profile_report import profile_summary
from .verify_cost import measure_verify_costs


@dataclass
class ArmRuns:
    """One arm's measurements, one entry per batch."""

    arm: Arm
    ttft_s: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)  # every row's, up to EOS
    longest_row: list[int] = field(default_factory=list)  # new tokens of the longest row
    batch_rows: list[int] = field(default_factory=list)  # rows of the batch
    forwards: list[int] = field(default_factory=list)  # target forwards of the full call
    tokens_per_row_step: list[float] = field(default_factory=list)  # ours: 1 + drafts accepted per row-step, per call
    metrics: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)  # ours: merged spec_metrics
    profile: StepProfile = field(default_factory=StepProfile)  # ours with --profile: decode steps by part
    rows: int = 0
    identical: int = 0
    divergences: list[dict] = field(default_factory=list)

    def tokens_per_s(self) -> list[float]:
        return [n / s for n, s in zip(self.new_tokens, self.seconds)]

    def decode_tokens_per_s(self) -> list[float | None]:
        """Per batch: the tokens after each row's first over the seconds after the first token (the
        run's less its TTFT): the decode phase alone, which the seed's formula prices. None for a
        batch with no decode phase to time (one token a row, or a run no longer than its TTFT call)."""
        return [
            (n - rows) / (s - t) if n > rows and s > t else None
            for n, rows, s, t in zip(self.new_tokens, self.batch_rows, self.seconds, self.ttft_s)
        ]

    def decode_step_s(self) -> float | None:
        """Seconds per forward after the first (the prompt's), pooled over batches."""
        steps = sum(f - 1 for f in self.forwards)
        return sum(s - t for s, t in zip(self.seconds, self.ttft_s)) / steps if steps > 0 else None


def interleaved_seconds(arms: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Each arm's wall times over `repeats` rounds: in each round every arm runs once, in an order rotated by one
    from the round before, so no arm always runs first or after the same other arm (the scripts' timing)."""
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for repeat in range(repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            started = time.perf_counter()
            arms[name]()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def run_benchmark(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], settings: BenchSettings, progress: bool = True
) -> dict:
    """Every arm of `settings` over `prompts`; returns the results (`report.py` prints / saves them).

    `model` must have `hf_specdec.enable(model)` applied; `tokenizer` pads on the left.
    """
    arms = build_arms(settings, model)
    runs = {arm.name: ArmRuns(arm) for arm in arms}
    batches = [prompts[i : i + settings.batch_size] for i in range(0, len(prompts), settings.batch_size)]
    eos_ids = _eos_ids(model, tokenizer)
    # one untimed short call per arm first: one-time costs (numba compiling the n-gram kernel, a
    # draft model's loading, allocator warm-up) must not land in the first batch's timings
    warmup = tokenizer(batches[0], return_tensors="pt", padding=True).to(model.device)
    for arm in arms:
        _generate(model, arm, {**warmup, **_generate_kwargs(arm, tokenizer, settings)}, max_new_tokens=2)
    verify_costs = (
        measure_verify_costs(model, warmup, arms, repeats=settings.verify_repeats) if settings.verify_repeats else {}
    )
    bar = tqdm(
        batches, desc=f"bench {settings.method} bs={settings.batch_size}", unit="batch", disable=not progress
    )
    for index, batch in enumerate(bar):
        inputs = tokenizer(batch, return_tensors="pt", padding=True).to(model.device)
        generated = {}  # arm -> each row's new tokens
        for arm in arms if index % 2 == 0 else arms[::-1]:
            torch.manual_seed(index)  # sampled runs: every arm of a batch starts from the same seed
            sequences = _run_arm(model, inputs, arm, settings, tokenizer, runs[arm.name])
            generated[arm.name] = [
                _row_tokens(row, eos_ids, tokenizer.pad_token_id)
                for row in sequences[:, inputs["input_ids"].shape[1] :].tolist()
            ]
            runs[arm.name].new_tokens.append(sum(len(row) for row in generated[arm.name]))
            runs[arm.name].longest_row.append(max(len(row) for row in generated[arm.name]))
            runs[arm.name].batch_rows.append(len(generated[arm.name]))
        first_prompt = index * settings.batch_size
        for arm in arms[1:] if settings.temperature is None else ():  # sampled rows differ draw for draw
            _compare_with_plain(
                model, inputs, generated["plain"], generated[arm.name], runs[arm.name], first_prompt
            )
        bar.set_postfix(
            ours_vs_plain=f"{runs['ours'].tokens_per_s()[-1] / runs['plain'].tokens_per_s()[-1]:.2f}x"
        )
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    results = summarize(
        runs, settings, num_prompts=len(prompts), weight_bytes=weight_bytes, verify_costs=verify_costs
    )
    backends = {settings.speculative_config(settings.k).cpu_linear_backend, *settings.cpu_linear_backends}
    if any(resolve_backend(backend, [model]) == "auto" for backend in backends):
        plan = linear_plan(model)  # stored for this machine, or timed on first use: the routes "auto" ran the target's linears by
        results["cpu_linear_plan"] = {
            "rows": list(plan.rows), "backends": list(plan.backends), "text": plan.describe(), "method": plan.method,
            "shape_backends": {shape: list(routes) for shape, routes in plan.shape_backends.items()},
            "source": plan.source, "path": plan.path,
        }  # fmt: skip
    return results


def _run_arm(model, inputs, arm: Arm, settings: BenchSettings, tokenizer, runs: ArmRuns) -> torch.Tensor:
    """The TTFT call then the full call; records their times (and ours' step profile with
    `settings.profile`); returns the full call's sequences."""
    common = {**inputs, **_generate_kwargs(arm, tokenizer, settings)}
    start = _now(model)
    _generate(model, arm, common, max_new_tokens=1)
    runs.ttft_s.append(_now(model) - start)
    profiled = settings.profile and arm.k is not None
    with profile_steps() if profiled else contextlib.nullcontext() as profile:
        start = _now(model)
        out = _generate(model, arm, common, max_new_tokens=settings.max_new_tokens)
        runs.seconds.append(_now(model) - start)
    if profile is not None:
        runs.profile.merge(profile)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    spec_metrics = getattr(out, "spec_metrics", None)
    if spec_metrics is not None:
        runs.metrics.merge(SpecDecodeMetrics.from_dict(spec_metrics))
        runs.forwards.append(spec_metrics["num_target_forwards"])
        runs.tokens_per_row_step.append(1 + spec_metrics["num_accepted_tokens"] / max(spec_metrics["num_row_steps"], 1))
    else:  # transformers' plain generate: one forward per generated column
        runs.forwards.append(sequences.shape[1] - inputs["input_ids"].shape[1])
    return sequences


def _generate(model, arm: Arm, kwargs: dict, max_new_tokens: int):
    assistant = kwargs.get("assistant_model")
    if assistant is not None:
        # transformers reads the number of candidates and their schedule from the assistant's own
        # generation config, not from generate()'s arguments (left there, 20 candidates would be
        # drafted); its "heuristic" schedule also writes its last count back there after each call
        kwargs = dict(kwargs)
        for option in ("num_assistant_tokens", "num_assistant_tokens_schedule"):
            setattr(assistant.generation_config, option, kwargs.pop(option))
    backend = arm.cpu_linear_backend
    with fast_cpu_linears(model, backend=backend) if backend else contextlib.nullcontext():
        return model.generate(**kwargs, max_new_tokens=max_new_tokens)


def _generate_kwargs(arm: Arm, tokenizer, settings: BenchSettings) -> dict:
    sampling = {"do_sample": False} if settings.temperature is None else {"do_sample": True, "temperature": settings.temperature}
    sampling.update({name: value for name, value in (("top_p", settings.top_p), ("top_k", settings.top_k)) if value is not None})
    return {**sampling, "pad_token_id": tokenizer.pad_token_id, **arm.generate_kwargs}


def _now(model) -> float:
    if model.device.type == "cuda":  # kernels run asynchronously: wait for them before reading the clock
        torch.cuda.synchronize(model.device)
    return time.perf_counter()


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def _row_tokens(row: list[int], eos_ids: set[int], pad_token_id: int | None) -> list[int]:
    """A row's new tokens up to and including its EOS; without one, less the padding at its end."""
    for position, token in enumerate(row):
        if token in eos_ids:
            return row[: position + 1]
    while row and row[-1] == pad_token_id:
        row = row[:-1]
    return row


def _compare_with_plain(
    model, inputs, plain: list[list[int]], other: list[list[int]], runs: ArmRuns, first_prompt: int
) -> None:
    """Counts the rows identical to plain; records each other row's first difference and top-2 gap."""
    for row, (expected, got) in enumerate(zip(plain, other)):
        runs.rows += 1
        if expected == got:
            runs.identical += 1
            continue
        position = next(
            (i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got))
        )
        prompt = inputs["input_ids"][row][inputs["attention_mask"][row].bool()]
        runs.divergences.append(
            {
                "prompt": first_prompt + row,
                "new_token": position,
                "top2_gap": top2_gap(model, prompt, expected[:position]),
            }
        )


def top2_gap(model: PreTrainedModel, prompt: torch.Tensor, generated: list[int]) -> float:
    """The target's top-2 logit gap for the token after `prompt` + `generated`: where greedy outputs
    differ, a gap near 0 is a near-tie (fp rounding may pick either), a large one a real bug."""
    ids = torch.cat([prompt, torch.tensor(generated, dtype=prompt.dtype, device=prompt.device)])
    with torch.no_grad():
        top2 = model(ids[None]).logits[0, -1].float().topk(2).values
    return float(top2[0] - top2[1])


def summarize(
    runs: dict[str, ArmRuns],
    settings: BenchSettings,
    num_prompts: int,
    weight_bytes: int | None = None,
    verify_costs: dict[str, dict] | None = None,
) -> dict:
    """Per-arm statistics, and the sweep against the closed form.

    `weight_bytes` (the target's parameters): each arm's effective bandwidth, weight bytes x target
    forwards per second, what a decode step is bound by (seed §12.5). `verify_costs`: per arm,
    `measure_verify_costs`' entry (an arm's `verify_cost`).
    """
    plain = runs["plain"]
    fast = runs.get("plain_fast_linears")
    plain_rates, fast_rates = plain.tokens_per_s(), fast.tokens_per_s() if fast else None
    # c compares ours' step with a plain step on the same GEMM route, where that arm ran
    plain_step = (fast or plain).decode_step_s()
    arms = {}
    for name, arm_runs in runs.items():
        rates = arm_runs.tokens_per_s()
        tpot = [
            (s - t) / (n - 1)
            for s, t, n in zip(arm_runs.seconds, arm_runs.ttft_s, arm_runs.longest_row)
            if n > 1
        ]
        summary = {
            "k": arm_runs.arm.k,
            "ttft_s": statistics.median(arm_runs.ttft_s),
            "tpot_s": statistics.median(tpot) if tpot else None,
            "tokens_per_s": statistics.median(rates),
            "tokens_per_s_per_batch": rates,  # in batch order: arms compared batch by batch (`bench_profile.py`)
            "ratio_vs_plain": statistics.median(r / p for r, p in zip(rates, plain_rates)),
            # None where no row was compared (plain itself; sampled runs, which differ draw for draw)
            "identical_fraction": arm_runs.identical / arm_runs.rows if arm_runs.rows else None,
            "identical_rows": arm_runs.identical,  # of `rows` compared with plain (plain itself: 0 of 0)
            "rows": arm_runs.rows,
            "divergences": arm_runs.divergences,
        }
        if weight_bytes:
            summary["weights_gb_per_s"] = weight_bytes * statistics.median(
                f / s for f, s in zip(arm_runs.forwards, arm_runs.seconds)
            ) / 1e9
        if fast_rates is not None:
            summary["ratio_vs_plain_fast_linears"] = statistics.median(r / p for r, p in zip(rates, fast_rates))
        # the same without the prefill (equal in every arm, and no part of a decode step)
        decode_ratios = [
            r / p for r, p in zip(arm_runs.decode_tokens_per_s(), (fast or plain).decode_tokens_per_s()) if r and p
        ]
        summary["decode_ratio"] = statistics.median(decode_ratios) if decode_ratios else None
        if arm_runs.arm.k is not None:
            summary.update(_speculation_summary(arm_runs, plain_step))
            summary["verify_cost"] = (verify_costs or {}).get(name)
        if settings.profile:
            summary["profile"] = (
                profile_summary(
                    arm_runs, plain_step, summary.get("ratio_vs_plain_fast_linears", summary["ratio_vs_plain"]),
                    summary["decode_ratio"], [r / p for r, p in zip(rates, fast_rates or plain_rates)],
                )
                if arm_runs.arm.k is not None
                else "not our loop: no breakdown (only ours' arms are profiled)"
            )
        arms[name] = summary
    results = {
        "settings": settings.to_dict(),
        "num_prompts": num_prompts,
        "target_weight_bytes": weight_bytes,
        "arms": arms,
    }
    if settings.sweep_ks:
        results["sweep"] = sweep_summary(runs, settings, arms)
    return results


def _speculation_summary(runs: ArmRuns, plain_step_s: float | None) -> dict:
    metrics = runs.metrics
    drafts_per_row_step = metrics.num_draft_tokens / metrics.num_row_steps if metrics.num_row_steps else 0.0
    step_s = runs.decode_step_s()
    c = None
    if step_s is not None and plain_step_s and drafts_per_row_step > 0:
        c = (step_s / plain_step_s - 1) / drafts_per_row_step
    config = runs.arm.generate_kwargs.get("speculative_config")
    tree = getattr(config, "tree", None)
    return {
        "tree": None if tree is None else tree_to_dict(tree),
        "mean_tree_size": metrics.num_draft_tokens / metrics.num_drafts if metrics.num_drafts else 0.0,
        "accepted_length_counts": metrics.accepted_length_counts,
        "accepted_length_histogram": [n / metrics.num_drafts for n in metrics.accepted_length_counts]
        if metrics.num_drafts
        else [],
        "tau": metrics.mean_acceptance_length,
        "alpha": metrics.conditional_acceptance_rate,
        "draft_acceptance_rate": metrics.draft_acceptance_rate,
        "acceptance_per_position": [n / metrics.num_drafts for n in metrics.num_accepted_tokens_per_pos]
        if metrics.num_drafts
        else [],
        "c": c,
        "drafts_per_row_step": drafts_per_row_step,
        "mean_k_chosen": metrics.mean_k_chosen,
        "k_chosen_counts": metrics.k_chosen_counts,
        "tokens_per_target_forward": metrics.num_emitted_tokens / max(metrics.num_target_forwards, 1),
        "time_split_s": {
            "draft": metrics.draft_seconds,
            "verify": metrics.verify_seconds,
            "sampler": metrics.sampler_seconds,
            "total": metrics.total_seconds,
        },
    }


def tree_to_dict(tree) -> dict:
    """A `TreeSpec` as JSON: {"num_nodes", "topk", "depth"}, and "static" (its paths) for a static tree."""
    out = {"num_nodes": tree.num_nodes, "topk": tree.topk, "depth": tree.depth}
    if tree.static_paths is not None:
        out["static"] = [list(path) for path in tree.static_paths]
    return out


def sweep_summary(runs: dict[str, ArmRuns], settings: BenchSettings, arms: dict[str, dict]) -> dict:
    """Measured speedup per k next to the closed form's, from the alpha and c measured over the sweep.

    alpha pools the sweep's acceptance counts; c is the median of the sweep arms' c (clamped at 0:
    a noisy negative value means drafts cost nothing measurable).
    """
    names = sweep_arm_names(settings)
    pooled = SpecDecodeMetrics()
    for name in names.values():
        pooled.merge(runs[name].metrics)
    alpha = pooled.conditional_acceptance_rate
    measured_c = [arms[name]["c"] for name in names.values() if arms[name]["c"] is not None]
    c = max(statistics.median(measured_c), 0.0) if measured_c else 0.0
    ks = sorted(names)
    return {
        "k": ks,
        "measured_speedup": [arms[names[k]]["ratio_vs_plain"] for k in ks],
        "predicted_speedup": [predicted_speedup(alpha, c, k) for k in ks],
        "alpha": alpha,
        "c": c,
    }
