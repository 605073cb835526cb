"""The benchmark's outputs: a text table, the JSON, and the speedup-vs-k PNG."""

from __future__ import annotations

import json
from pathlib import Path

from ..loop.auto_k import predicted_speedup
from .profile_report import format_profile

COLUMNS = (
    # (header, key, format)
    ("arm", None, "{}"),
    ("k", "k", "{}"),
    ("TTFT ms", "ttft_s", "{:.1f}"),
    ("TPOT ms", "tpot_s", "{:.2f}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("x plain", "ratio_vs_plain", "{:.2f}"),
    ("x plain_fast_linears", "ratio_vs_plain_fast_linears", "{:.2f}"),
    ("weights GB/s", "weights_gb_per_s", "{:.1f}"),
    ("tau", "tau", "{:.2f}"),
    ("alpha", "alpha", "{:.2f}"),
    ("c", "c", "{:.3f}"),
    ("mean k", "mean_k_chosen", "{:.2f}"),
    ("nodes", "mean_tree_size", "{:.1f}"),
    ("verify N", ("verify_cost", "nodes"), "{}"),
    ("verify x", ("verify_cost", "ratio"), "{:.2f}"),
    ("identical", "identical_fraction", "{:.0%}"),
)
MILLISECONDS = ("ttft_s", "tpot_s")


def format_table(results: dict) -> str:
    """One line per arm (blank where an arm has no such value), then ours' acceptance per position."""
    lines = []
    for name, arm in results["arms"].items():
        cells = []
        for _, key, fmt in COLUMNS:
            value = name if key is None else _value(arm, key)
            if key in MILLISECONDS and value is not None:
                value *= 1000
            cells.append("" if value is None else fmt.format(value))
        lines.append(cells)
    header = [title for title, _, _ in COLUMNS]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    text = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [header, *lines]]
    settings = results["settings"]
    title = (
        f"{settings['method']}, batch size {settings['batch_size']}, {results['num_prompts']} prompts, "
        f"max_new_tokens {settings['max_new_tokens']}, "
        + ("greedy" if settings.get("temperature") is None else f"sampled at temperature {settings['temperature']}")
        + "".join(f", {name.replace('_', '-')} {settings[name]}" for name in ("top_p", "top_k") if settings.get(name) is not None)
    )
    text.insert(0, title)
    costs = [arm["verify_cost"] for arm in results["arms"].values() if arm.get("verify_cost")]
    if costs:
        text.append(
            f"nodes: draft tokens (tree nodes) per drafted row-step; verify x: a target forward over verify N + 1 "
            f"tokens per row / a 1-token forward, batch {costs[0]['batch_size']} (median of {costs[0]['repeats']})"
        )
    text.extend(format_profile(results))
    if "cpu_linear_plan" in results:
        text.append(f"fp32 CPU linears (auto): {results['cpu_linear_plan']['text']}")
    for name, arm in results["arms"].items():
        if arm.get("acceptance_per_position"):
            per_position = " ".join(f"{p:.2f}" for p in arm["acceptance_per_position"])
            text.append(f"{name}: accepted per position {per_position}")
        if arm.get("tree"):
            tree = arm["tree"]
            shape = f"static, {tree['num_nodes']} nodes" if "static" in tree else (
                f"num_nodes {tree['num_nodes']}, topk {tree['topk']}, depth {tree['depth']}"
            )
            text.append(f"{name}: tree {shape}")
        if arm.get("accepted_length_histogram"):
            histogram = " ".join(f"{p:.2f}" for p in arm["accepted_length_histogram"])
            text.append(f"{name}: accepted length 0, 1, ...: {histogram}")
        for divergence in arm["divergences"]:
            text.append(f"{name}: differs from plain at {divergence}")
    return "\n".join(text)


def _value(arm: dict, key: str | tuple[str, str]):
    if isinstance(key, tuple):
        outer = arm.get(key[0])
        return None if outer is None else outer.get(key[1])
    return arm.get(key)


def write_json(results: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1))


def write_speedup_png(results: dict, path: str | Path) -> None:
    """Measured speedup over plain per k of the sweep, next to the closed form (seed §12.5) from the
    alpha and c measured over the same runs; "auto", when benchmarked, as a horizontal line."""
    # the object API, not pyplot: no global backend to switch (a Figure renders with Agg by itself)
    from matplotlib.figure import Figure

    sweep = results["sweep"]
    alpha, c = sweep["alpha"], sweep["c"]
    figure = Figure(figsize=(6, 4), dpi=120)
    axes = figure.subplots()
    dense = range(1, max(sweep["k"]) + 1)
    axes.plot(
        list(dense),
        [predicted_speedup(alpha, c, k) for k in dense],
        "--",
        label=f"predicted (1-a^(k+1))/((1-a)(1+ck)), a={alpha:.2f}, c={c:.3f}",
    )
    axes.plot(sweep["k"], sweep["measured_speedup"], "o-", label="measured")
    ours = results["arms"]["ours"]
    if ours["k"] == "auto":
        axes.axhline(
            ours["ratio_vs_plain"],
            color="green",
            linestyle=":",
            label=f"auto (mean k {ours['mean_k_chosen']:.1f})",
        )
    if "transformers" in results["arms"]:
        axes.axhline(
            results["arms"]["transformers"]["ratio_vs_plain"],
            color="gray",
            linestyle="-.",
            label="transformers",
        )
    axes.axhline(1.0, color="black", linewidth=0.5)
    settings = results["settings"]
    axes.set_title(
        f"{settings['method']}, batch size {settings['batch_size']}, {results['num_prompts']} prompts"
    )
    axes.set_xticks(list(dense))
    axes.set_xlabel("k (num_speculative_tokens)")
    axes.set_ylabel("speedup over plain generate()")
    axes.legend(fontsize=7)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
