"""The step profile (`profiling.py`), the formula's prediction from it (`bench/profile_report.py`),
and `hf-specdec bench --profile` / `--temperature`."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch
from conftest import EOS_TOKEN_ID, PAD_TOKEN_ID, build_tiny_llama, load_benchmark
from test_bench_cli import bench_args, model_folder, prompts_file  # noqa: F401 (fixtures)
from test_eagle import random_head
from test_mtp import mtp_config, target  # noqa: F401 (fixture)

import hf_specdec
from hf_specdec import cli
from hf_specdec.bench.arms import Arm
from hf_specdec.bench.profile_report import fitted_alpha, profile_summary
from hf_specdec.bench.runner import ArmRuns
from hf_specdec.loop.auto_k import expected_tokens, predicted_speedup
from hf_specdec.loop.metrics import SpecDecodeMetrics
from hf_specdec.profiling import SECTIONS, StepProfile, profile_steps

PROMPT = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6]])


@pytest.fixture(scope="module")
def llama():
    model = build_tiny_llama()
    hf_specdec.enable(model)
    return model


def generate(model, config: dict, **kwargs):
    return model.generate(
        PROMPT, max_new_tokens=24, do_sample=False, pad_token_id=PAD_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
        speculative_config=config, return_dict_in_generate=True, **kwargs,
    )  # fmt: skip


CONFIGS = {
    "ngram": lambda model: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "layer_skip": lambda model: {"method": "layer_skip", "early_exit_layer": 1, "num_speculative_tokens": 3},
    "draft_model": lambda model: {"method": "draft_model", "model": build_tiny_llama(seed=1), "num_speculative_tokens": 3},
    "eagle3": lambda model: {"method": "eagle3", "model": random_head(model, "eagle3"), "num_speculative_tokens": 3},
    "eagle_tree": lambda model: {
        "method": "eagle", "model": random_head(model, "eagle"), "num_speculative_tokens": 3, "tree": {"num_nodes": 6},
    },
    "mtp": lambda model: mtp_config(k=2),
}


@pytest.mark.parametrize("drafter", list(CONFIGS))
def test_profile_splits_every_decode_step_without_changing_the_output(llama, drafter, request):
    model = request.getfixturevalue("target") if drafter == "mtp" else llama  # test_mtp's DeepSeek-V3
    config = CONFIGS[drafter](model)
    plain = generate(model, config).sequences
    started = time.perf_counter()
    with profile_steps() as profile:
        out = generate(model, config)
    wall = time.perf_counter() - started
    assert torch.equal(out.sequences, plain)  # profiling changes no token
    metrics = out.spec_metrics
    assert profile.num_steps == metrics["num_target_forwards"] - 1  # every step but the prompt's
    per_step = profile.per_step_ms()
    assert set(per_step) == {*SECTIONS, "total"}
    assert all(per_step[part] >= 0 for part in SECTIONS), per_step
    assert per_step["verify_forward"] > 0 and per_step["sampling"] > 0 and per_step["emit"] > 0
    # an n-gram lookup runs no network; the early exit runs the target's first layer k times a step
    if drafter == "ngram":
        assert per_step["draft_forward"] == 0 and per_step["draft_other"] > 0
    else:
        assert per_step["draft_forward"] > 0
    # the parts are disjoint: together no longer than the call itself
    assert per_step["total"] * profile.num_steps / 1000 <= wall


def test_no_profile_outside_the_block(llama):
    config = {"method": "ngram", "num_speculative_tokens": 3}
    with profile_steps() as profile:
        pass
    generate(llama, config)
    assert profile.num_steps == 0 and profile.per_step_ms() == {}


@pytest.mark.parametrize("alpha,k", [(0.0, 3), (0.35, 1), (0.7, 4), (0.93, 8)])
def test_fitted_alpha_inverts_the_numerator(alpha, k):
    assert fitted_alpha(expected_tokens(alpha, k), k) == pytest.approx(alpha, abs=1e-6)
    assert fitted_alpha(1.0, 0) is None


def test_prediction_is_the_seed_formula_for_a_full_chain():
    """Every step drafting k with measured tau and drafter time: predicted = formula(a fitted, c, k)."""
    k, alpha, steps = 4, 0.8, 100
    runs = ArmRuns(Arm("ours", {}, k))
    tau = expected_tokens(alpha, k)
    runs.metrics = SpecDecodeMetrics(
        num_drafts=steps, num_draft_tokens=k * steps, num_accepted_tokens=round((tau - 1) * steps), num_row_steps=steps
    )
    runs.profile = StepProfile()
    runs.profile.num_steps = steps
    plain_step_s, draft_s = 0.020, 0.004  # each step's drafter forwards: 0.2 plain steps, c = 0.05
    runs.profile.seconds.update(draft_forward=draft_s * steps, verify_forward=0.021 * steps, emit=0.001 * steps)
    summary = profile_summary(runs, plain_step_s, measured_ratio=2.0, decode_ratio=2.2)
    assert summary["c"] == pytest.approx(0.05)
    assert summary["alpha_fit"] == pytest.approx(alpha, abs=1e-3)
    expected = predicted_speedup(alpha, 0.05, k)
    assert summary["predicted_speedup"] == pytest.approx(expected, rel=1e-3)
    assert summary["measured_over_predicted"] == pytest.approx(2.0 / expected, rel=1e-3)
    assert summary["decode_over_predicted"] == pytest.approx(2.2 / expected, rel=1e-3)
    assert summary["per_step_ms"]["total"] == pytest.approx(26.0)
    assert summary["per_step_plain_steps"]["verify_forward"] == pytest.approx(1.05)
    # with the forwards as measured (0.2 + 1.05 plain steps) and nothing else; the emit is the loop's own
    assert summary["forward_bound_speedup"] == pytest.approx(tau / 1.25, rel=1e-3)
    assert summary["loop_overhead"] == pytest.approx(0.05)


def test_per_batch_comparison_sets_each_batch_against_its_own_acceptance():
    """Batches that accept differently: the median of measured ratios comes from the middle batches, the pooled
    tokens per row-step from all steps alike; per batch, each batch's ratio meets its own prediction."""
    runs = ArmRuns(Arm("ours", {}, 4))
    runs.metrics = SpecDecodeMetrics(num_drafts=300, num_draft_tokens=1200, num_accepted_tokens=150, num_row_steps=300)
    runs.profile = StepProfile()
    runs.profile.num_steps = 300
    runs.profile.seconds.update(draft_forward=0.002 * 300, verify_forward=0.02 * 300)  # c k = 0.1
    runs.tokens_per_row_step = [1.1, 1.2, 2.2]  # pooled: 1.5
    batch_ratios = [1.1 / 1.1 * 0.9, 1.2 / 1.1 * 0.9, 2.2 / 1.1 * 0.9]  # each batch at 0.9 of its own prediction
    summary = profile_summary(runs, 0.02, measured_ratio=statistics.median(batch_ratios), batch_ratios=batch_ratios)
    assert summary["measured_over_predicted_per_batch"] == pytest.approx(0.9)
    assert summary["measured_over_predicted"] == pytest.approx(1.2 / 1.1 * 0.9 / (1.5 / 1.1))  # 0.72: pooled
    assert profile_summary(runs, 0.02, measured_ratio=1.0)["measured_over_predicted_per_batch"] is None


def test_decode_rate_leaves_the_prefill_out_and_skips_batches_without_a_decode_phase():
    runs = ArmRuns(Arm("ours", {}, 4))
    # batch 1: 2 rows, 66 tokens in 5 s with a 1 s TTFT; batch 2: one token a row; batch 3: ran no longer than its TTFT
    runs.new_tokens, runs.batch_rows, runs.seconds, runs.ttft_s = [66, 2, 40], [2, 2, 2], [5.0, 1.0, 0.9], [1.0, 0.5, 1.0]
    assert runs.decode_tokens_per_s() == [16.0, None, None]


def test_bench_profile_and_temperature(model_folder, prompts_file, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "results.json"
    status = cli.main(
        bench_args(model_folder, prompts_file, "--method", "layer_skip", "--early-exit-layer", "1", "--k", "2",
                   "--plain-fast-linears", "--profile", "--temperature", "0.7", "--out", str(out))
    )  # fmt: skip
    assert status == 0
    results = json.loads(out.read_text())
    assert results["settings"]["profile"] is True and results["settings"]["temperature"] == 0.7
    arms = results["arms"]
    assert arms["plain"]["profile"].startswith("not our loop")
    profile = arms["ours"]["profile"]
    assert profile["num_steps"] > 0 and profile["per_step_ms"]["draft_forward"] > 0
    assert profile["predicted_speedup"] > 0
    assert profile["measured_over_predicted"] == pytest.approx(
        arms["ours"]["ratio_vs_plain_fast_linears"] / profile["predicted_speedup"]
    )
    assert profile["decode_speedup"] == arms["ours"]["decode_ratio"] > 0
    assert profile["decode_over_predicted"] == pytest.approx(arms["ours"]["decode_ratio"] / profile["predicted_speedup"])
    assert arms["ours"]["rows"] == 0  # sampled: not compared token for token
    table = capsys.readouterr().out
    assert "sampled at temperature 0.7" in table and "meas/pred" in table and "decode/pred" in table
    assert "plain: not our loop: no breakdown" in table


def test_bench_profile_compares_auto_with_the_best_k_batch_by_batch():
    """`bench_profile.py --summarize`: auto k against the best fixed k as the ratio of their medians over
    batches (each over plain's on the batch) and as the median of auto / best on each batch."""
    arm = lambda k, rates, ratio: {"k": k, "tokens_per_s_per_batch": rates, "ratio_vs_plain_fast_linears": ratio}  # noqa: E731
    result = {"num_prompts": 3, "settings": {"batch_size": 1}, "arms": {
        "ours": arm("auto", [10.0, 12.0, 9.0], 1.30), "ours_k2": arm(2, [9.0, 11.0, 10.0], 1.25),
        "ours_k4": arm(4, [10.0, 10.0, 10.0], 1.40),
    }}  # fmt: skip
    lines = load_benchmark("bench_profile").summarize({"run": result}).splitlines()
    assert lines[-1] == (
        "  auto k 1.30x against the best fixed k (ours_k4) 1.40x: 92.9%; batch by batch (median of auto / ours_k4): 100.0%"
    )


def test_bench_temperature_must_be_positive(model_folder, prompts_file, capsys):  # noqa: F811
    with pytest.raises(SystemExit) as info:
        cli.main(bench_args(model_folder, prompts_file, "--method", "ngram", "--temperature", "0"))
    assert info.value.code == 2
    assert "--temperature=0.0: allowed: a number > 0" in capsys.readouterr().err
