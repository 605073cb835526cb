"""`hf-specdec bench --profile`: ours' decode step by part, next to what the seed's formula predicts.

The formula (seed §12.5) prices a step: speedup = (1 - a^(k+1)) / ((1 - a)(1 + c k)), a the
acceptance rate, c the cost of one draft step relative to a target step. Its numerator is the tokens
a step yields; its denominator assumes verifying k + 1 tokens costs one plain step and that nothing
but the drafter's forwards is added. So, from the run itself:

- draft cost c k = the drafter's forward time per decode step / plain's time per decode step (on
  the same CPU linears where that arm ran): the method's own price; the drafter's bookkeeping is
  ours, not the method's, and is left out;
- tokens per row-step = 1 + accepted drafts per (row, step), drafted or not (with every step
  drafting k, exactly the formula's numerator at the a that gives the measured tau);
- predicted = tokens per row-step / (1 + c k); measured = ours' tokens/s over plain's, end to end
  (the prompt's prefill, which costs every arm the same, included: with 64 new tokens of a 1.5B
  model on a CPU it is a tenth of plain's time), and over the decode phase alone (tokens after
  the first over the time after it: what the formula prices);
  measured / predicted below 1 is what the formula leaves out: a verify forward dearer than a plain
  step (on CPUs, fp32 GEMMs of 4+ rows cost up to 2x one row) and our loop's own work (bookkeeping,
  sampling, emit, glue);
- per batch: measured is the median over batches of each batch's ratio, while tokens per row-step
  pools every step; where batches differ in acceptance the two weigh them differently, so each
  batch's ratio is also set against the prediction from its own tokens per row-step (c as above),
  and the median of those is reported beside;
- forward bound = tokens per row-step / ((drafter forwards + verify forward) / plain step): the
  speedup with the forwards as measured and nothing else; measured / forward bound is our loop's
  share alone, `loop_overhead` its time per step in plain steps.
"""

from __future__ import annotations

import statistics

from ..profiling import SECTIONS


def profile_summary(
    runs, plain_step_s: float | None, measured_ratio: float, decode_ratio: float | None = None,
    batch_ratios: list[float] | None = None,
) -> dict:  # fmt: skip
    """The profile entry of an arm of ours (`runs`: its `ArmRuns`); `plain_step_s`: plain's seconds per
    decode step (plain_fast_linears' where it ran); `measured_ratio`: ours' tokens/s over that arm's (the
    median over batches); `decode_ratio`: the same over the decode phase alone; `batch_ratios`: each
    batch's tokens/s over that arm's, for the per-batch comparison below."""
    metrics, per_step = runs.metrics, runs.profile.per_step_ms()
    out = {"num_steps": runs.profile.num_steps, "per_step_ms": per_step}
    if not per_step or not plain_step_s or not metrics.num_row_steps:
        return {**out, "predicted_speedup": None, "measured_over_predicted": None}
    plain_ms = 1000 * plain_step_s
    draft_cost = per_step["draft_forward"] / plain_ms  # c k
    drafts_per_drafted_row_step = metrics.num_draft_tokens / metrics.num_drafts if metrics.num_drafts else 0.0
    tokens_per_row_step = 1 + metrics.num_accepted_tokens / metrics.num_row_steps
    predicted = tokens_per_row_step / (1 + draft_cost)
    forward_bound = tokens_per_row_step / ((per_step["draft_forward"] + per_step["verify_forward"]) / plain_ms)
    return {
        **out,
        "plain_step_ms": plain_ms,
        "per_step_plain_steps": {part: value / plain_ms for part, value in per_step.items()},
        "c": draft_cost / drafts_per_drafted_row_step if drafts_per_drafted_row_step else None,
        "alpha_fit": fitted_alpha(metrics.mean_acceptance_length, drafts_per_drafted_row_step),
        "tokens_per_row_step": tokens_per_row_step,
        "predicted_speedup": predicted,
        "measured_speedup": measured_ratio,
        "measured_over_predicted": measured_ratio / predicted,
        # each batch's measured ratio over the prediction from its own tokens per row-step, the median of those:
        # the median ratio above comes from batches whose acceptance differs, the pooled prediction weighs
        # every step alike (HumanEval at batch 1: 1.15-2.17 tokens per step, pooled 1.38, median 1.21)
        "measured_over_predicted_per_batch": _median_over_batches(
            batch_ratios, runs.tokens_per_row_step, 1 + draft_cost
        ),
        "decode_speedup": decode_ratio,
        "decode_over_predicted": decode_ratio / predicted if decode_ratio else None,
        "forward_bound_speedup": forward_bound,
        "measured_over_forward_bound": measured_ratio / forward_bound,
        "loop_overhead": (per_step["total"] - per_step["draft_forward"] - per_step["verify_forward"]) / plain_ms,
        # below the batch size: rows that finished early leave steps that cost nearly a full batch's
        # (a weight-bound forward) for fewer tokens, which the per-row formula does not see
        "mean_rows_per_step": metrics.num_row_steps / metrics.num_target_forwards if metrics.num_target_forwards else None,
    }


def _median_over_batches(batch_ratios: list[float] | None, tokens_per_row_step: list[float], step_cost: float) -> float | None:
    pairs = [(ratio, tokens) for ratio, tokens in zip(batch_ratios or [], tokens_per_row_step) if tokens]
    if not pairs:
        return None
    return statistics.median(ratio / (tokens / step_cost) for ratio, tokens in pairs)


def fitted_alpha(tau: float, k: float) -> float | None:
    """The a at which the formula's numerator (1 - a^(k+1)) / (1 - a) equals the measured tau at k
    drafts (k may be a mean, not an integer); None without drafts."""
    if k <= 0:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):  # the numerator rises with a from 1 (a = 0) to k + 1 (a = 1)
        middle = (low + high) / 2
        if sum(middle**i for i in range(int(k) + 1)) + (k - int(k)) * middle ** (int(k) + 1) < tau:
            low = middle
        else:
            high = middle
    return low


def format_profile(results: dict) -> list[str]:
    """Lines of the profile table (ms per decode step by part, then the prediction); [] without one."""
    arms = {name: arm["profile"] for name, arm in results["arms"].items() if "profile" in arm}
    if not arms:
        return []
    columns = [*SECTIONS, "total"]
    header = [
        "arm", *columns, "plain", "c", "tok/row-step", "predicted", "measured", "meas/pred", "per batch", "decode",
        "decode/pred", "meas/fwd bound",
    ]  # fmt: skip
    rows = []
    for name, profile in arms.items():
        if isinstance(profile, str):
            rows.append([name, profile])
            continue
        per_step = profile["per_step_ms"]
        cells = [name, *(f"{per_step[c]:.2f}" if per_step else "" for c in columns)]
        for key, fmt in (
            ("plain_step_ms", "{:.2f}"), ("c", "{:.3f}"), ("tokens_per_row_step", "{:.2f}"),
            ("predicted_speedup", "{:.2f}x"), ("measured_speedup", "{:.2f}x"), ("measured_over_predicted", "{:.2f}"),
            ("measured_over_predicted_per_batch", "{:.2f}"), ("decode_speedup", "{:.2f}x"), ("decode_over_predicted", "{:.2f}"), ("measured_over_forward_bound", "{:.2f}"),
        ):  # fmt: skip
            value = profile.get(key)
            cells.append("" if value is None else fmt.format(value))
        rows.append(cells)
    table = [row for row in rows if len(row) == len(header)]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    lines = ["decode step by part (ms per step; plain: plain's ms per decode step), the formula's prediction:"]
    lines.append("  ".join(cell.rjust(width) for cell, width in zip(header, widths)))
    for row in rows:
        lines.append("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) if len(row) == len(header) else f"{row[0]}: {row[1]}")
    return lines
