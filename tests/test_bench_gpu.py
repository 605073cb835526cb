"""benchmarks/bench_gpu.py without a GPU: `--cpu-smoke` end to end in a subprocess (its JSON, and ours
token-identical to plain greedy with the oracle's drafts accepted; the tree arm too, its tau above
the chain's), the oracle drafter's acceptance in chain and tree form, the grid's tree cells, and the
bf16 target whose greedy walk the oracle can follow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_benchmark

from hf_specdec.config import SpeculativeConfig, TreeSpec
from hf_specdec.drafters import ProposeRequest
from hf_specdec.sampling.tree import check_tree, children_of, tree_depths

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
TREE_CELL_KEYS = CELL_KEYS | {
    "arm", "tree", "nodes_per_step", "chain", "ratio_vs_chain", "tau_ratio_vs_chain", "verify_forward_ms",
    "verify_forward_ratio_vs_chain", "measured_alpha_per_depth", "num_drafts", "num_accepted_tokens",
}  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_gpu")


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
    assert results["exactness"] == {
        "ours_rows": 3, "ours_divergent_rows": 0, "tree_rows": 3, "tree_divergent_rows": 0, "must_match": True,
    }  # fmt: skip
    for key in ("batch1_context64", "batch2_context64"):
        assert ARM_KEYS <= set(results["plain"][key])
        static = results["compiled"][key]
        assert ARM_KEYS <= set(static) and static["compiled"] is False and "eager" in static["how"]
        assert static["exactness_vs_plain"]["divergent_rows"] == 0
    assert "skipped" in results["compile_arm"]
    assert "rows identical" in smoke["stdout"] and "3/3 rows identical (tree arm: 3/3)" in smoke["stdout"]


def test_cpu_smoke_tree_arm_matches_plain_and_beats_the_chains_tau(smoke):
    results = smoke["results"]
    assert results["args"]["tree_widths"] == [2, 2] and results["args"]["tree_cells"] == "all"
    assert [(c["kind"], c["batch"], c["k"]) for c in results["grid"] if c["kind"] != "compiled"] == [
        ("ours", 1, 2), ("ours_tree", 1, 2), ("ours", 2, 2), ("ours_tree", 2, 2),
    ]  # fmt: skip
    chains = {(cell["batch"], cell["context"], cell["alpha"], cell["k"]): cell for cell in results["cells"]}
    trees = results["tree_cells"]
    assert [(cell["batch"], cell["context"], cell["alpha"], cell["k"]) for cell in trees] == list(chains)
    alpha_per_depth = [1 - 0.2**2, 1 - 0.2**2]  # per-candidate: 1 - (1 - alpha)^width
    for cell in trees:
        assert TREE_CELL_KEYS <= set(cell), sorted(TREE_CELL_KEYS - set(cell))
        chain = chains[(cell["batch"], cell["context"], cell["alpha"], cell["k"])]
        assert cell["arm"] == "ours_tree" and chain["arm"] == "ours"
        assert cell["exactness_vs_plain"] == {"rows": cell["batch"], "divergent_rows": 0, "divergences": []}
        tree = cell["tree"]
        assert {key: tree[key] for key in ("widths", "num_nodes", "topk", "depth", "acceptance")} == {
            "widths": [2, 2], "num_nodes": 6, "topk": 2, "depth": 2, "acceptance": "per-candidate",
        }  # fmt: skip
        assert tree["alpha_per_depth"] == pytest.approx(alpha_per_depth)
        assert tree["speculative_config"] == {
            "method": "ngram", "num_speculative_tokens": 2, "cpu_linear_backend": "torch",
            "tree": {"num_nodes": 6, "topk": 2, "depth": 2},
        }  # fmt: skip
        assert cell["expected_tokens_per_step"] == pytest.approx(1 + 0.96 + 0.96**2)
        # full trees, shallower only on a row's last steps
        assert (
            3 <= cell["nodes_per_step"] <= 6
            and cell["drafts_per_drafting_row_step"] == cell["nodes_per_step"]
        )
        assert cell["tau"] == pytest.approx(1 + cell["num_accepted_tokens"] / cell["num_drafts"])
        # the same draws as the chain: the tree accepts at least what the chain does
        assert cell["tau"] >= chain["tau"] > 1.0 and cell["target_forwards"] <= chain["target_forwards"]
        assert cell["chain"]["tau"] == chain["tau"] and cell["chain"]["k"] == chain["k"] == 2
        assert cell["ratio_vs_chain"] == pytest.approx(cell["tokens_per_s"] / chain["tokens_per_s"])
        assert cell["tau_ratio_vs_chain"] == pytest.approx(cell["tau"] / chain["tau"])
        assert cell["verify_forward_ms"] == cell["per_step_ms"]["decode_forward"] > 0
        assert cell["verify_forward_ratio_vs_chain"] == pytest.approx(
            cell["verify_forward_ms"] / chain["per_step_ms"]["decode_forward"]
        )
        assert len(cell["measured_alpha_per_depth"]) == 2 and all(
            0 < a <= 1 for a in cell["measured_alpha_per_depth"]
        )
        assert cell["ratio_vs_compiled"] is not None and cell["ratio_vs_plain"] > 0
    pooled = [sum(cell[key] for cell in cells) for cells in (trees, list(chains.values()))
              for key in ("num_accepted_tokens", "num_drafts")]  # fmt: skip
    assert 1 + pooled[0] / pooled[1] > 1 + pooled[2] / pooled[3]  # alpha 0.8 < 1: the tree's tau is above
    checks = results["smoke_checks"]
    assert checks and all(check["ok"] for check in checks), checks
    assert any("pooled" in check["check"] for check in checks)
    assert "HEADLINE tree b=1" in smoke["stdout"] and "smoke check FAILED" not in smoke["stdout"]


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


def test_tree_topology_and_carrier_config(bench):
    topology = bench.tree_topology((4, 2, 2, 1))
    assert topology["upto"].tolist() == [0, 4, 12, 28, 44]
    parents = topology["parents"]
    check_tree(np.arange(44), parents)  # parents first
    assert tree_depths(parents).tolist() == topology["depths"].tolist()
    assert [len(children) for children in children_of(parents)[:13]] == [4] + [2] * 4 + [2] * 8
    assert bench.tree_spec((4, 2, 2, 1)) == {"num_nodes": 44, "topk": 4, "depth": 4}
    # ngram carries a tree: the library's own parse of the tree arm's config
    config = SpeculativeConfig.from_any(bench.carrier_config(4, (4, 2, 2, 1)))
    assert config.method == "ngram" and config.num_speculative_tokens == 4
    assert (config.tree.num_nodes, config.tree.topk, config.tree.depth) == (44, 4, 4)
    assert isinstance(config.tree, TreeSpec) and config.tree.static_paths is None
    assert "tree" not in bench.carrier_config(4)
    assert bench.expected_tree_tokens([0.8] * 4) == pytest.approx(bench.expected_tokens(0.8, 4))
    assert bench.tree_alpha_per_depth(0.8, (4, 2, 1), "per-candidate") == pytest.approx(
        [1 - 0.2**4, 0.96, 0.8]
    )
    assert bench.tree_alpha_per_depth(0.8, (4, 2, 1), "per-depth") == [0.8] * 3


def _on_path_stats(proposal, reference_rows, generated, widths):
    """Per depth: how often the reference sits under the on-path node, at which rank; and that no
    other node at that depth holds it."""
    hits, ranks = np.zeros(len(widths)), []
    for tokens, parents, ref, g in zip(
        proposal.draft_token_ids, proposal.draft_parents, reference_rows, generated
    ):
        check_tree(tokens, parents)
        children, node = children_of(parents), -1
        depths = tree_depths(parents)
        for d in range(len(widths)):
            if node is None:
                break
            right = ref[g + d]
            on_path = children[node + 1]
            assert len(on_path) == widths[d]
            holders = [n for n in np.flatnonzero(depths == d + 1) if tokens[n] == right]
            assert set(holders) <= set(on_path)  # nodes off the correct path: wrong children only
            found = [rank for rank, n in enumerate(on_path) if tokens[n] == right]
            if found:
                hits[d] += 1
                ranks.append((d, found[0]))
                node = on_path[found[0]]
            else:
                node = None
    return hits / len(generated), ranks


@pytest.mark.parametrize("acceptance", ["per-candidate", "per-depth"])
def test_tree_oracle_puts_the_reference_under_the_correct_path_at_the_set_rate(bench, acceptance):
    widths, alpha, rows = (3, 2, 1), 0.6, 600
    reference = np.random.default_rng(1).integers(0, 50, (rows, 20))
    oracle = bench.OracleProposer(reference, 5, alpha, 50, seed=3, widths=widths, acceptance=acceptance)
    generated = np.random.default_rng(2).integers(0, 10, rows)
    request = ProposeRequest(
        rows=list(range(rows)),
        token_ids=[np.zeros(5 + g, np.int64) for g in generated],
        max_draft_tokens=[3] * rows,
    )
    proposal = oracle.propose(request)
    assert all(len(t) == 3 + 6 + 6 for t in proposal.draft_token_ids)
    assert all(0 <= t.min() and t.max() < 50 for t in proposal.draft_token_ids)
    rates, ranks = _on_path_stats(proposal, reference, generated, widths)
    # P(path reaches depth d) = a_1 ... a_d
    expected = np.cumprod(bench.tree_alpha_per_depth(alpha, widths, acceptance))
    np.testing.assert_allclose(rates, expected, atol=0.06)
    first_depth = np.bincount([rank for d, rank in ranks if d == 0], minlength=3) / (rates[0] * rows)
    if acceptance == "per-candidate":  # rank c with chance alpha (1 - alpha)^c, given a hit
        np.testing.assert_allclose(first_depth, [0.6, 0.24, 0.096] / expected[0], atol=0.06)
    else:  # uniform
        np.testing.assert_allclose(first_depth, [1 / 3] * 3, atol=0.07)
    # the chain oracle of the same seed: its draft is the reference exactly when the tree's top candidate is
    chain = bench.OracleProposer(reference, 5, alpha, 50, seed=3).propose(request).draft_token_ids
    for tokens, parents, drafts, ref, g in zip(
        proposal.draft_token_ids, proposal.draft_parents, chain, reference, generated
    ):
        top = tokens[children_of(parents)[0][0]]
        if acceptance == "per-candidate":
            assert (top == ref[g]) == (drafts[0] == ref[g])
            if drafts[0] != ref[g]:
                assert top == drafts[0]  # the same wrong token 0
        else:
            assert (ref[g] in tokens[:3]) == (drafts[0] == ref[g])


def test_tree_oracle_cuts_depth_to_the_rows_draft_limit(bench):
    reference = np.arange(40).reshape(2, 20)
    oracle = bench.OracleProposer(reference, 4, 1.0, 64, seed=0, widths=(2, 2, 1))
    proposal = oracle.propose(
        ProposeRequest(rows=[1, 0], token_ids=[np.zeros(4 + 17, np.int64), np.zeros(4, np.int64)],
                       max_draft_tokens=[2, 0])
    )  # fmt: skip
    assert [len(t) for t in proposal.draft_token_ids] == [6, 0]
    assert proposal.draft_parents[0].tolist() == [-1, -1, 0, 0, 1, 1]
    tokens = proposal.draft_token_ids[0]
    # alpha 1: the reference under the root and under the node that holds it
    on_path = [n for n in range(6) if tokens[n] == reference[1, 17 + (n >= 2)]]
    assert len(on_path) == 2 and proposal.draft_parents[0][on_path[1]] == on_path[0]


def test_tree_cells_in_the_grid(bench):
    grid = bench.with_compile_choice(bench.default_grid(), "headline")
    cells = bench.with_tree_cells(grid, 4, "headline")
    trees = [(i, cell) for i, cell in enumerate(cells) if cell.kind == "ours_tree"]
    assert [(cell.batch, cell.context, cell.alpha, cell.k) for _, cell in trees] == [
        (1, 1024, 0.8, 4), (32, 1024, 0.8, 4),
    ]  # fmt: skip
    assert all(
        cells[i - 1] == bench.Cell("ours", cell.batch, cell.context, cell.alpha, 4) for i, cell in trees
    )
    assert [cell for cell in cells if cell.kind != "ours_tree"] == grid
    assert bench.with_tree_cells(grid, 4, "none") == grid
    # every (batch, context, alpha), a chain of k = depth added where the grid has none
    every = bench.with_tree_cells(grid, 3, "all")
    keys = {(c.batch, c.context, c.alpha) for c in grid if c.kind == "ours"}
    assert sorted((c.batch, c.context, c.alpha) for c in every if c.kind == "ours_tree") == sorted(keys)
    for i, cell in enumerate(every):
        if cell.kind == "ours_tree":
            assert every[i - 1] == bench.Cell("ours", cell.batch, cell.context, cell.alpha, 3)
    assert len(every) == len(grid) + 2 * len(keys) and len(set(every)) == len(every)


def test_tree_widths_are_checked_before_any_work(bench, capsys):
    args = bench.parse_args([])
    assert args.tree_widths == (4, 2, 2, 1) and args.tree_cells == "headline"
    assert args.tree_acceptance == "per-candidate"
    assert bench.parse_args(["--tree-widths", "none"]).tree_cells == "none"
    for bad in ("17,1", "16,16", "2,0", "2,x"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--tree-widths", bad])
        assert "--tree-widths" in capsys.readouterr().err


def test_tree_arm_per_depth_accepts_the_chains_tokens(bench):
    """per-depth: the tree holds the reference exactly where the chain's draft is it, so the two arms
    take the same steps, tau for tau; output plain's."""
    model = bench.build_target(bench.SMOKE_SHAPE, torch.float32, torch.device("cpu"), 0.1, "random", seed=0)
    args = bench.parse_args(["--cpu-smoke", "--repeats", "1", "--tree-acceptance", "per-depth"])
    run = bench.run_plain(model, 2, 16, args, weight_bytes=1)
    chain = bench.run_ours(model, run, 0.7, 3, args, weight_bytes=1)
    tree = bench.run_ours(model, run, 0.7, 3, args, weight_bytes=1, widths=(3, 2, 1))
    tree = bench.add_tree_fields(tree, chain, (3, 2, 1), "per-depth")
    assert tree["exactness_vs_plain"]["divergent_rows"] == 0 == chain["exactness_vs_plain"]["divergent_rows"]
    assert (tree["num_accepted_tokens"], tree["num_drafts"]) == (
        chain["num_accepted_tokens"],
        chain["num_drafts"],
    )
    assert tree["tau"] == chain["tau"] < 4 and tree["nodes_per_step"] > 3
    assert tree["tree"]["num_nodes"] == 3 + 6 + 6 and tree["expected_tokens_per_step"] == pytest.approx(
        bench.expected_tokens(0.7, 3)
    )


def test_serving_figure_cpu_smoke():
    """benchmarks/bench_serve_gpu.py --cpu-smoke: requests joining a running engine with the oracle
    drafter and without; every request's tokens are plain generate()'s, and the oracle's drafts are
    accepted (what the GPU run relies on)."""
    results = load_benchmark("bench_serve_gpu").main(["--cpu-smoke", "--repeats", "1"])
    assert results["mode"] == "cpu-smoke" and set(results["levels"]) == {"1", "4"}
    for level in results["levels"].values():
        for arm in ("off", "oracle"):
            assert level[arm]["requests"] == results["settings"]["requests_per_run"]
            assert level[arm]["divergent_from_plain_generate"] == 0
            assert level[arm]["ttft_ms_p50"] > 0 and level[arm]["tpot_ms_p95"] >= level[arm]["tpot_ms_p50"]
        assert level["tau"] > 1.5  # alpha 0.8, k 4: about 3 tokens a step
