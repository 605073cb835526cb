"""benchmarks/bench_gpu.py without a GPU: `--cpu-smoke` end to end in a subprocess (its JSON, and ours
token-identical to plain greedy with the oracle's drafts accepted), the oracle drafter's acceptance,
and the bf16 target whose greedy walk the oracle can follow."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_specdec.drafters import ProposeRequest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_gpu.py"
PER_STEP_KEYS = {
    "total",
    "forward",
    "draft",
    "verify",
    "sampler",
    "loop_overhead",
    "decode_step",
    "decode_forward",
}
CELL_KEYS = {
    "tokens_per_s", "ratio_vs_plain", "ratio_vs_compiled", "ttft_s", "tau", "measured_alpha", "per_step_ms",
    "expected_tokens_per_step", "step_cost_ratio", "c", "predicted_speedup", "measured_decode_speedup",
    "exactness_vs_plain", "target_forwards", "weights_gb_per_s",
}  # fmt: skip
ARM_KEYS = {"tokens_per_s", "ttft_s", "decode_step_ms", "wall_s", "seconds"}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench_gpu") / "smoke.json"
    # the reference attention only: conftest turns Triton's interpreter on for this process
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--cpu-smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {"results": json.loads(out.read_text()), "stdout": proc.stdout}


def test_cpu_smoke_ours_matches_plain_with_the_oracles_drafts_accepted(smoke):
    results = smoke["results"]
    assert results["mode"] == "cpu-smoke" and results["errors"] == [] and results["skipped"] == []
    assert (
        results["target"]["dtype"] == "torch.float32" and results["target"]["config"]["weights"] == "random"
    )
    cells = results["cells"]
    assert [(cell["batch"], cell["context"], cell["alpha"], cell["k"]) for cell in cells] == [
        (1, 64, 0.8, 2),
        (2, 64, 0.8, 2),
    ]
    max_new_tokens = results["args"]["max_new_tokens"]
    for cell in cells:
        assert CELL_KEYS <= set(cell), sorted(CELL_KEYS - set(cell))
        assert PER_STEP_KEYS <= set(cell["per_step_ms"])
        # fp32: every row token-identical to plain greedy
        assert cell["exactness_vs_plain"] == {"rows": cell["batch"], "divergent_rows": 0, "divergences": []}
        # the oracle's drafts were verified and accepted: fewer forwards than tokens
        assert cell["target_forwards"] < max_new_tokens and cell["tau"] > 1.0
        assert 0.0 < cell["measured_alpha"] <= 1.0
        assert cell["expected_tokens_per_step"] == pytest.approx((1 - 0.8**3) / (1 - 0.8))
        assert cell["predicted_speedup"] == pytest.approx(
            cell["expected_tokens_per_step"] / cell["step_cost_ratio"]
        )
        assert cell["tokens_per_s"] > 0 and cell["measured_decode_speedup"] > 0
        assert cell["ratio_vs_compiled"] is not None  # filled in once the shape's static-cache arm ran
    assert results["exactness"] == {"ours_rows": 3, "ours_divergent_rows": 0, "must_match": True}
    for key in ("batch1_context64", "batch2_context64"):
        assert ARM_KEYS <= set(results["plain"][key])
        static = results["compiled"][key]
        assert ARM_KEYS <= set(static) and static["compiled"] is False and "eager" in static["how"]
        assert static["exactness_vs_plain"]["divergent_rows"] == 0
    assert "skipped" in results["compile_arm"]
    assert "rows identical" in smoke["stdout"] and "3/3 rows identical" in smoke["stdout"]


def test_cpu_smoke_attention_section_runs_the_reference(smoke):
    attention = smoke["results"]["attention"]
    assert attention["kernel"].startswith("not run")  # no TRITON_INTERPRET in the subprocess
    cases = {(case["context"], case["batch"]): case for case in attention["cases"]}
    assert set(cases) == {(64, 1), (64, 2), (256, 1), (256, 2)}
    assert all(case["reference_ms"] > 0 and "error" not in case for case in cases.values())


def test_reference_attention_matches_per_row_causal_attention(bench):
    """The bench's gather + SDPA reference against attention written out per row and head."""
    heads, query_len = (4, 2, 8), 3
    case = bench.attention_case(2, 37, heads, query_len, 16, torch.float32, torch.device("cpu"), seed=0)
    got = bench.reference_paged_attention(
        case["query"], case["key_pool"], case["value_pool"], case["block_table"], case["seq_lens"], query_len,
        case["scale"], {},
    )  # fmt: skip
    for row in range(2):
        slots = torch.cat([torch.arange(b * 16, b * 16 + 16) for b in case["block_table"][row].tolist()])[:37]
        keys = case["key_pool"].reshape(-1, 2, 8)[slots]
        values = case["value_pool"].reshape(-1, 2, 8)[slots]
        for i in range(query_len):
            position = 37 - query_len + i
            for head in range(4):
                q = case["query"][row * query_len + i, head]
                scores = keys[: position + 1, head // 2] @ q * case["scale"]
                expected = torch.softmax(scores, 0) @ values[: position + 1, head // 2]
                torch.testing.assert_close(got[row * query_len + i, head], expected, rtol=1e-5, atol=1e-5)


def test_oracle_proposes_the_reference_with_wrong_tokens_at_rate_one_minus_alpha(bench):
    reference = np.arange(100, 100 + 2 * 4000).reshape(2, 4000) % 50
    oracle = bench.OracleProposer(reference, prompt_len=5, alpha=0.7, vocab_size=50, seed=0)
    request = ProposeRequest(
        rows=[0, 1],
        token_ids=[np.zeros(5 + 10, np.int64), np.zeros(5 + 3, np.int64)],
        max_draft_tokens=[4, 2],
    )
    drafts = oracle.propose(request).draft_token_ids
    assert [len(d) for d in drafts] == [4, 2]
    right = [reference[0, 10:14], reference[1, 3:5]]
    assert all(((d == r) | ((d != r) & (d >= 0) & (d < 50))).all() for d, r in zip(drafts, right))
    # over many positions: right with probability alpha, never a valid id equal to the reference otherwise
    long = ProposeRequest(rows=[0], token_ids=[np.zeros(5, np.int64)], max_draft_tokens=[4000])
    draft = oracle.propose(long).draft_token_ids[0]
    assert abs((draft == reference[0]).mean() - 0.7) < 0.03 and draft.min() >= 0 and draft.max() < 50
    exact = (
        bench.OracleProposer(reference, 5, alpha=1.0, vocab_size=50, seed=0).propose(long).draft_token_ids[0]
    )
    np.testing.assert_array_equal(exact, reference[0])


def test_decisive_bf16_target_keeps_ours_identical_to_plain(bench):
    """The GPU default target (bf16, decisive greedy walk), scaled down: ours reproduces plain greedy
    token for token and the oracle's acceptance comes out near the alpha asked for."""
    shape = dict(bench.SMOKE_SHAPE, hidden_size=256, intermediate_size=512, vocab_size=4096)
    model = bench.build_target(shape, torch.bfloat16, torch.device("cpu"), 0.005, "decisive", seed=0)
    args = bench.parse_args(["--cpu-smoke", "--max-new-tokens", "48", "--repeats", "1"])
    run = bench.run_plain(model, 3, 32, args, weight_bytes=1)
    with torch.no_grad():  # the walk is decisive: top-1 far above the runner-up at every step
        sequences = torch.cat([run.prompts, torch.from_numpy(run.reference)], dim=1)
        top2 = model(sequences).logits[:, 31:-1].float().topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 4.0
    cell = bench.run_ours(model, run, 0.8, 4, args, weight_bytes=1)
    assert cell["exactness_vs_plain"]["divergent_rows"] == 0
    assert 0.6 < cell["measured_alpha"] < 0.95
