"""Block vs token-wise verification (`rejection_sample_method`) on SmolLM2-135M-Instruct, sampling.

    python benchmarks/bench_block_verification.py --out results/bench_block_verification.json
    python benchmarks/bench_block_verification.py --prompts 3 --max-new-tokens 32 --temperatures 1.0

MT-bench first turns, batch 1, sampled at each temperature with top-k / top-p off. Drafters:
the committed EAGLE-3 head (`model_cards/SmolLM2-135M-Instruct-eagle3`, method eagle3) and the
target's own first N layers (`layer_skip`, N = 24 of 30 by default: no smaller SmolLM2 exists on
PyPI to serve as a `draft_model`, and shallower exits are accepted so rarely when sampling (tau
~1.1-1.2 at N = 12-18, T = 1) that both verifications reject nearly every first draft). The
defaults (8 prompts, 64 new tokens, k = 4, 2 temperatures) take ~12 minutes on 2 busy cores. Arms, interleaved per prompt (the order rotates from prompt to prompt, so machine
noise hits them alike): plain sampled `generate()` (the speed baseline), then per drafter
"token" and "block", each with the same seed (`speculative_config.seed`; plain: torch.manual_seed)
so the two verifications see the same random draws.

Per drafter the script also records whether it handed the sampler its q (`draft_probs`): block
verification changes nothing in distribution for one-hot drafts (EAGLE heads draft their argmax),
so there block and token differ by noise only.

Reported per temperature and arm: medians over prompts of tau (`mean_acceptance_length`: 1 +
accepted drafts per drafting step), tokens per target forward (`num_emitted_tokens /
num_target_forwards`) and tokens/s; per drafter the ratios block / token of the medians; and the
machine's load average before and after (other processes share its cores).

The realised tau of a few prompts is noisy (sampled outputs diverge, and each step's accept
decisions are random), so every drafting step also records E[accepted | its drafts] under both
rules, computed from the step's p and q (`expected_accepted`): averaged over all steps of both
arms, the two are compared on the same drafts, the uniforms' noise integrated out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import hf_specdec
from hf_specdec.loop import step
from hf_specdec.models.real_models import load_smollm2, mtbench_prompts

EAGLE3_HEAD = Path(__file__).resolve().parents[1] / "model_cards" / "SmolLM2-135M-Instruct-eagle3"


def expected_accepted(
    metadata, logits: torch.Tensor, is_greedy: torch.Tensor, draft_probs
) -> list[tuple[float, float]]:
    """Per sampled row with drafts: (E[accepted | drafts] under block verification, under token-wise).

    Given the drafted block X_1..X_g, only the uniforms and the noise are random: token-wise
    P(tau >= i | X) = prod_{j <= i} min(1, p(X_j) / q(X_j)); block P(tau >= i | X) = 1 - prod_{j >= i}
    (1 - h_j), h as in `hf_specdec.sampling.block_verification` (float64 here). Averaged over the
    steps of a run (X drawn from q along outputs that follow the target), each is that method's
    expected accepted length with the uniforms' noise integrated out: the two are compared on the
    very same drafts, so their ratio needs far fewer prompts than the realised tau's."""
    probs = torch.softmax(logits.double(), dim=-1)
    results = []
    for row, count in enumerate(metadata.num_draft_tokens):
        if count == 0 or bool(is_greedy[row]):
            continue
        index = torch.arange(
            int(metadata.cu_num_draft_tokens[row]) - count, int(metadata.cu_num_draft_tokens[row])
        )
        drafts = metadata.draft_token_ids[index].cpu()
        p_rows = probs[metadata.target_logits_indices[index].cpu()]
        p = p_rows.gather(1, drafts[:, None])[:, 0]
        q_rows = None if draft_probs is None else draft_probs[index.to(draft_probs.device)].double().cpu()
        q = torch.ones_like(p) if q_rows is None else q_rows.gather(1, drafts[:, None])[:, 0]
        ratio = torch.where(q > 0, p / q.clamp_min(1e-300), (p > 0).double())
        token = float(torch.cumprod(ratio.clamp(max=1.0), dim=0).sum())
        weights, weight = [], 1.0
        for i in range(count):
            weight = min(weight * float(ratio[i]), 1.0)
            weights.append(weight)  # weights[i] = w_{i+1}
        stops = []  # stops[i] = h_{i+1}
        for i in range(1, count):
            w = weights[i - 1]
            if q_rows is None:
                mass = w - w * float(p[i])
            else:
                mass = float((w * p_rows[i] - q_rows[i]).clamp_min(0.0).sum())
            denominator = mass + 1.0 - w
            stops.append(mass / denominator if denominator > 0 else 0.0)
        stops.append(weights[-1])
        block, survive = 0.0, 1.0
        for i in reversed(range(count)):  # P(tau >= i + 1) = 1 - prod_{j >= i} (1 - h_{j+1})
            survive *= 1.0 - stops[i]
            block += 1.0 - survive
        results.append((block, token))
    return results


class SamplerProbe:
    """Wraps the loop's sampler: counts its calls, those that got the drafter's q (`draft_probs`),
    and sums `expected_accepted` over the drafting rows."""

    def __init__(self):
        self.reset()
        original = step.rejection_sample
        probe = self

        def probed(metadata, logits, is_greedy, draws=None, draft_probs=None, method="token"):
            probe.calls += 1
            probe.with_q += int(draft_probs is not None)
            for block, token in expected_accepted(metadata, logits, is_greedy, draft_probs):
                probe.rows += 1
                probe.block += block
                probe.token += token
                probe.squares += (block - token) ** 2
            return original(metadata, logits, is_greedy, draws=draws, draft_probs=draft_probs, method=method)

        step.rejection_sample = probed

    def reset(self) -> None:
        self.calls = self.with_q = self.rows = 0
        self.block = self.token = self.squares = 0.0


def new_token_count(sequences: torch.Tensor, prompt_width: int, eos_token_id: int) -> int:
    row = sequences[0, prompt_width:].tolist()
    return row.index(eos_token_id) + 1 if eos_token_id in row else len(row)


def drafter_configs(args) -> dict[str, dict]:
    return {
        "eagle3": {"method": "eagle3", "model": str(EAGLE3_HEAD), "num_speculative_tokens": args.k},
        f"layer_skip_N{args.exit_layer}": {
            "method": "layer_skip",
            "early_exit_layer": args.exit_layer,
            "num_speculative_tokens": args.k,
        },
    }


def run_temperature(
    model, tokenizer, prompts: list[str], temperature: float, args, counter: SamplerProbe
) -> dict:
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    arms: dict[str, dict | None] = {"plain": None}
    for drafter, config in drafter_configs(args).items():
        for method in ("token", "block"):
            arms[f"{drafter}_{method}"] = {**config, "rejection_sample_method": method}
    names = list(arms)
    per_arm = {
        arm: {"tokens_per_s": [], "tau": [], "tokens_per_forward": [], "new_tokens": []} for arm in names
    }
    q_calls = {arm: [0, 0] for arm in names if arm != "plain"}
    # rows, sum of E[accepted] block, token, accepted drafts, sum of squared block - token differences
    expected = {arm: [0, 0.0, 0.0, 0, 0.0] for arm in names if arm != "plain"}
    for index, prompt in enumerate(prompts):
        inputs = tokenizer([prompt], return_tensors="pt")
        width = inputs.input_ids.shape[1]
        seed = args.seed + index
        shift = index % len(names)
        for arm in names[shift:] + names[:shift]:
            counter.reset()
            kwargs = dict(**inputs, max_new_tokens=args.max_new_tokens, **sampling)
            if arms[arm] is None:
                torch.manual_seed(seed)
            else:
                kwargs.update(speculative_config={**arms[arm], "seed": seed}, return_dict_in_generate=True)
            start = time.perf_counter()
            out = model.generate(**kwargs)
            seconds = time.perf_counter() - start
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            count = new_token_count(sequences, width, tokenizer.eos_token_id)
            per_arm[arm]["tokens_per_s"].append(count / seconds)
            per_arm[arm]["new_tokens"].append(count)
            if arms[arm] is not None:
                metrics = out.spec_metrics
                per_arm[arm]["tau"].append(metrics["mean_acceptance_length"])
                per_arm[arm]["tokens_per_forward"].append(
                    metrics["num_emitted_tokens"] / max(metrics["num_target_forwards"], 1)
                )
                q_calls[arm][0] += counter.calls
                q_calls[arm][1] += counter.with_q
                expected[arm][0] += counter.rows
                expected[arm][1] += counter.block
                expected[arm][2] += counter.token
                expected[arm][3] += metrics["num_accepted_tokens"]
                expected[arm][4] += counter.squares
        print(
            f"  T={temperature} prompt {index + 1}/{len(prompts)}: "
            + ", ".join(
                f"{arm} {per_arm[arm]['tokens_per_s'][-1]:.1f} tok/s"
                + (f" tau {per_arm[arm]['tau'][-1]:.2f}" if per_arm[arm]["tau"] else "")
                for arm in names
            ),
            flush=True,
        )

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    summary = {
        arm: {
            "median_tau": median(values["tau"]),
            "median_tokens_per_forward": median(values["tokens_per_forward"]),
            "median_tokens_per_s": median(values["tokens_per_s"]),
            "per_prompt": values,
        }
        for arm, values in per_arm.items()
    }
    plain = summary["plain"]["median_tokens_per_s"]
    for arm, values in summary.items():
        values["speed_vs_plain"] = values["median_tokens_per_s"] / plain
        if arm in q_calls:
            calls, with_q = q_calls[arm]
            values["sampler_calls"], values["sampler_calls_with_draft_probs"] = calls, with_q
            rows, block, token, accepted, _ = expected[arm]
            values["drafting_steps"] = rows
            values["accepted_per_drafting_step"] = accepted / max(rows, 1)
            values["expected_accepted_block"] = block / max(rows, 1)
            values["expected_accepted_token"] = token / max(rows, 1)
    ratios = {}
    for drafter in drafter_configs(args):
        token, block = summary[f"{drafter}_token"], summary[f"{drafter}_block"]
        ratios[drafter] = {
            key: block[key] / token[key]
            for key in ("median_tau", "median_tokens_per_forward", "median_tokens_per_s")
        }
        # paired per prompt (same seed): mean of block tau - token tau
        differences = [b - t for b, t in zip(block["per_prompt"]["tau"], token["per_prompt"]["tau"])]
        ratios[drafter]["mean_paired_tau_difference"] = statistics.fmean(differences)
        ratios[drafter]["drafts_sampled_with_q"] = token["sampler_calls_with_draft_probs"] > 0
        # E[accepted | drafts], block over token, on the drafting steps of both arms together
        rows = [expected[f"{drafter}_{method}"] for method in ("token", "block")]
        steps, block_sum, token_sum = (sum(r[i] for r in rows) for i in range(3))
        mean_difference = (block_sum - token_sum) / max(steps, 1)
        variance = sum(r[4] for r in rows) / max(steps, 1) - mean_difference**2
        ratios[drafter]["expected_accepted_per_step"] = {
            "steps": steps,
            "block": block_sum / max(steps, 1),
            "token": token_sum / max(steps, 1),
            "ratio": block_sum / token_sum if token_sum else None,
            # the steps' block - token differences: mean and its standard error (steps taken as independent)
            "difference": mean_difference,
            "difference_standard_error": (max(variance, 0.0) / max(steps - 1, 1)) ** 0.5,
        }
    return {"temperature": temperature, "arms": summary, "block_over_token": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=8, help="MT-bench first turns")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument(
        "--exit-layer",
        type=int,
        default=24,
        help="layer_skip's early_exit_layer (of 30; at 12-18 tau ~1.1-1.2)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1000, help="prompt i runs every arm with seed + i")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    parser.add_argument("--out", default="results/bench_block_verification.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    model, tokenizer = load_smollm2()
    hf_specdec.enable(model)
    counter = SamplerProbe()
    prompts = mtbench_prompts(tokenizer, limit=args.prompts)
    started = time.perf_counter()
    runs = []
    for temperature in args.temperatures:
        run = run_temperature(model, tokenizer, prompts, temperature, args, counter)
        runs.append(run)
        print(json.dumps({"temperature": temperature, "block_over_token": run["block_over_token"]}, indent=1))
    results = {
        "args": vars(args),
        "model": "SmolLM2-135M-Instruct (fp32, CPU)",
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_seconds": time.perf_counter() - started,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
