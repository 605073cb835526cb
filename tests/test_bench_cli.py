"""`hf-specdec bench` end to end on a tiny random Llama saved with a word-level chat tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_llama

from hf_specdec import cli
from hf_specdec.bench.arms import BenchSettings, build_arms, tree_arm_names
from hf_specdec.bench.verify_cost import timing_tree
from hf_specdec.config import TreeSpec
from hf_specdec.models.cpu_linear import PLAN_ROWS
from hf_specdec.sampling.tree import children_of, tree_depths

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# user turns as their words, then "w3" opens the answer: every piece is in the word vocabulary
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
PROMPTS = [
    {"prompt": "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"},
    {"messages": [{"role": "user", "content": "w20 w21 w22 w20 w21 w22 w20"}]},
    {"prompt": "w40 w41 w42 w43 w44 w40 w41 w42 w43"},
]
SPEC_KEYS = {"tau", "alpha", "acceptance_per_position", "c", "mean_k_chosen", "k_chosen_counts", "tree",
             "mean_tree_size", "accepted_length_counts", "accepted_length_histogram", "verify_cost"}  # fmt: skip
ARM_KEYS = {"k", "ttft_s", "tpot_s", "tokens_per_s", "tokens_per_s_per_batch", "ratio_vs_plain", "identical_fraction", "identical_rows", "rows",
            "divergences"}  # fmt: skip
VERIFY_KEYS = {"nodes", "tokens_per_row", "batch_size", "tree", "decode_forward_s", "verify_forward_s", "ratio",
               "ratio_of_minimums", "repeats"}  # fmt: skip


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("tiny_chat_llama")
    build_tiny_llama().save_pretrained(folder)
    tokenizer = request.getfixturevalue("word_tokenizer")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    tokenizer.chat_template = None  # the session fixture is shared
    return folder


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in PROMPTS) + "\n")
    return path


def bench_args(model_folder, prompts_file, *extra: str) -> list[str]:
    return [
        "bench", "--model", str(model_folder), "--prompts", str(prompts_file), "--max-new-tokens", "12",
        "--device", "cpu", "--no-progress", *extra,
    ]  # fmt: skip


def test_bench_ngram_auto_with_sweep_png_and_json(model_folder, prompts_file, tmp_path, capsys):
    out, png = tmp_path / "results.json", tmp_path / "speedup.png"
    status = cli.main(
        bench_args(model_folder, prompts_file, "--method", "ngram", "--k", "auto", "--batch-size", "1",
                   "--ks", "1,3", "--out", str(out), "--png", str(png))
    )  # fmt: skip
    assert status == 0
    results = json.loads(out.read_text())
    assert results["num_prompts"] == 3
    assert results["settings"]["k"] == "auto" and results["settings"]["sweep_ks"] == [1, 3]
    arms = results["arms"]
    assert list(arms) == ["plain", "transformers", "ours", "ours_k1", "ours_k3"]
    for name, arm in arms.items():
        assert ARM_KEYS <= set(arm), name
        assert arm["tokens_per_s"] > 0 and arm["ttft_s"] > 0
        assert len(arm["tokens_per_s_per_batch"]) == 3 and min(arm["tokens_per_s_per_batch"]) > 0  # a prompt per batch
        # TPOT is (full call - separate TTFT call) / tokens: on this tiny model both calls take a few ms,
        # so CPU noise can push the difference below 0; only its presence is behaviour
        assert isinstance(arm["tpot_s"], float)
    assert arms["plain"]["ratio_vs_plain"] == 1.0
    plan = results["cpu_linear_plan"]  # the routes "auto" measured and ran the fp32 linears by
    assert plan["rows"] == list(PLAN_ROWS) and len(plan["backends"]) == len(PLAN_ROWS)
    for name in ("ours", "ours_k1", "ours_k3"):  # greedy: exactly plain's tokens
        assert SPEC_KEYS <= set(arms[name]), name
        assert arms[name]["identical_fraction"] == 1.0 and arms[name]["divergences"] == []
        assert 0.0 <= arms[name]["alpha"] <= 1.0
    assert arms["ours_k3"]["k"] == 3 and len(arms["ours_k3"]["k_chosen_counts"]) == 4
    assert sum(arms["ours"]["k_chosen_counts"]) > 0
    sweep = results["sweep"]
    assert sweep["k"] == [1, 3] and len(sweep["measured_speedup"]) == len(sweep["predicted_speedup"]) == 2
    assert 0.0 <= sweep["alpha"] <= 1.0 and sweep["c"] >= 0.0
    assert png.read_bytes()[:8] == PNG_MAGIC
    table = capsys.readouterr().out
    assert "TTFT ms" in table and "ours_k3" in table and "accepted per position" in table
    assert f"fp32 CPU linears (auto): {plan['text']}" in table


def test_bench_batched_layer_skip_has_no_transformers_arm(model_folder, prompts_file, tmp_path):
    out = tmp_path / "results.json"
    status = cli.main(
        bench_args(model_folder, prompts_file, "--method", "layer_skip", "--early-exit-layer", "1",
                   "--k", "2", "--batch-size", "2", "--num-prompts", "3", "--out", str(out), "--plain-fast-linears")
    )  # fmt: skip
    assert status == 0
    results = json.loads(out.read_text())
    # transformers' assisted generation is batch size 1 only
    assert list(results["arms"]) == ["plain", "plain_fast_linears", "ours"]
    assert "sweep" not in results
    for name in ("plain_fast_linears", "ours"):
        assert results["arms"][name]["identical_fraction"] == 1.0
        assert results["arms"][name]["ratio_vs_plain_fast_linears"] > 0
        assert results["arms"][name]["weights_gb_per_s"] > 0
    assert results["arms"]["ours"]["k_chosen_counts"][2] > 0


def test_bench_samples_with_the_given_top_p_and_top_k(model_folder, prompts_file, tmp_path, capsys, monkeypatch):
    from hf_specdec.bench import runner

    seen = []
    generate_kwargs = runner._generate_kwargs
    monkeypatch.setattr(runner, "_generate_kwargs", lambda *args: seen.append(generate_kwargs(*args)) or seen[-1])
    out = tmp_path / "results.json"
    extra = ["--method", "ngram", "--k", "2", "--num-prompts", "1", "--temperature", "0.9", "--top-p", "0.8", "--top-k", "5"]
    assert cli.main(bench_args(model_folder, prompts_file, *extra, "--out", str(out))) == 0
    settings = json.loads(out.read_text())["settings"]
    assert (settings["temperature"], settings["top_p"], settings["top_k"]) == (0.9, 0.8, 5)
    assert "sampled at temperature 0.9, top-p 0.8, top-k 5" in capsys.readouterr().out
    assert seen and all((kw["do_sample"], kw["temperature"], kw["top_p"], kw["top_k"]) == (True, 0.9, 0.8, 5) for kw in seen)


def test_bench_compares_cpu_linear_backends(model_folder, prompts_file, tmp_path):
    out = tmp_path / "results.json"
    status = cli.main(
        bench_args(model_folder, prompts_file, "--method", "ngram", "--k", "2", "--batch-size", "2",
                   "--cpu-linear-backend", "torch", "--compare-cpu-linear-backends", "auto,torch,numba",
                   "--out", str(out))
    )  # fmt: skip
    assert status == 0
    results = json.loads(out.read_text())
    # ours runs torch itself: no second torch arm
    assert list(results["arms"]) == ["plain", "ours", "ours_auto", "ours_numba"]
    assert results["settings"]["cpu_linear_backends"] == ["auto", "torch", "numba"]
    for name in ("ours", "ours_auto", "ours_numba"):
        arm = results["arms"][name]
        assert arm["k"] == 2 and arm["identical_fraction"] == 1.0 and arm["tokens_per_s"] > 0
        assert SPEC_KEYS <= set(arm), name
    assert results["cpu_linear_plan"]["rows"] == list(PLAN_ROWS)  # an "auto" arm ran: its plan is reported
    # each extra arm carries its own backend, the rest of ours' config unchanged
    settings = BenchSettings(method="ngram", k=2, extra_config={"cpu_linear_backend": "torch"},
                             cpu_linear_backends=("auto", "torch", "numba"))  # fmt: skip
    arms = {arm.name: arm for arm in build_arms(settings, build_tiny_llama())}
    for name, backend in (("ours", "torch"), ("ours_auto", "auto"), ("ours_numba", "numba")):
        config = arms[name].generate_kwargs["speculative_config"]
        assert (config.cpu_linear_backend, config.method, config.num_speculative_tokens) == (backend, "ngram", 2)


def test_bench_compares_methods(model_folder, prompts_file, tmp_path):
    out = tmp_path / "results.json"
    status = cli.main(
        bench_args(model_folder, prompts_file, "--method", "suffix", "--k", "3", "--batch-size", "2",
                   "--compare-methods", "ngram,suffix", "--out", str(out))
    )  # fmt: skip
    assert status == 0
    results = json.loads(out.read_text())
    assert list(results["arms"]) == ["plain", "ours", "ours_ngram"]  # ours is suffix itself
    assert results["settings"]["compare_methods"] == ["ngram", "suffix"]
    for name in ("ours", "ours_ngram"):
        arm = results["arms"][name]
        assert arm["k"] == 3 and arm["identical_fraction"] == 1.0 and SPEC_KEYS <= set(arm), name
    settings = BenchSettings(method="suffix", k=3, extra_config={"suffix_max_tree_depth": 8}, compare_methods=("ngram",))
    arms = {arm.name: arm for arm in build_arms(settings, build_tiny_llama())}
    ngram = arms["ours_ngram"].generate_kwargs["speculative_config"]
    assert (ngram.method, ngram.num_speculative_tokens) == ("ngram", 3)
    assert arms["ours"].generate_kwargs["speculative_config"].suffix_max_tree_depth == 8


def check_tree_arm(arm: dict, nodes: int, tree: dict | None, batch_size: int, verify_tree: bool) -> None:
    """The fields a tree (or chain) arm reports, and that they add up."""
    assert SPEC_KEYS <= set(arm) and arm["tree"] == tree
    assert arm["identical_fraction"] == 1.0 and arm["identical_rows"] == arm["rows"] > 0
    assert arm["tokens_per_s"] > 0 and arm["ratio_vs_plain"] > 0 and arm["tau"] >= 1.0
    assert 0 < arm["mean_tree_size"] <= nodes
    counts = arm["accepted_length_counts"]
    assert sum(counts) > 0 and arm["accepted_length_histogram"] == pytest.approx([n / sum(counts) for n in counts])
    # tau = 1 + accepted / drafted steps: the histogram's mean accepted length
    assert arm["tau"] == pytest.approx(1 + sum(a * n for a, n in enumerate(counts)) / sum(counts))
    cost = arm["verify_cost"]
    assert VERIFY_KEYS <= set(cost)
    assert (cost["nodes"], cost["tokens_per_row"], cost["batch_size"], cost["tree"]) == (nodes, nodes + 1, batch_size, verify_tree)
    assert cost["ratio"] == pytest.approx(cost["verify_forward_s"] / cost["decode_forward_s"])
    assert cost["ratio"] > 0 and cost["ratio_of_minimums"] > 0


def test_bench_tree_nodes_against_the_chain(model_folder, prompts_file, tmp_path, capsys):
    out = tmp_path / "results.json"
    status = cli.main(
        bench_args(model_folder, prompts_file, "--method", "ngram", "--k", "3", "--batch-size", "2",
                   "--tree-nodes", "4,8", "--tree-topk", "2", "--plain-fast-linears", "--verify-repeats", "2",
                   "--out", str(out))
    )  # fmt: skip
    assert status == 0
    results = json.loads(out.read_text())
    arms = results["arms"]
    assert list(arms) == ["plain", "plain_fast_linears", "ours", "ours_tree4", "ours_tree8"]
    assert results["settings"]["trees"] == [{"num_nodes": 4, "topk": 2}, {"num_nodes": 8, "topk": 2}]
    check_tree_arm(arms["ours"], 3, None, batch_size=2, verify_tree=False)  # the chain: k = 3 drafts
    for nodes in (4, 8):
        arm = arms[f"ours_tree{nodes}"]
        check_tree_arm(arm, nodes, {"num_nodes": nodes, "topk": 2, "depth": 3}, batch_size=2, verify_tree=True)
        assert arm["k"] == 3 and arm["ratio_vs_plain_fast_linears"] > 0
    assert arms["plain"].get("verify_cost") is None
    table = capsys.readouterr().out
    assert "verify x" in table and "ours_tree8: tree num_nodes 8, topk 2, depth 3" in table
    assert "ours_tree4: accepted length 0, 1, ...:" in table


def test_bench_tree_for_ours_static_and_deeper_trees(model_folder, prompts_file, tmp_path):
    """--tree makes ours draft that tree; --tree-depth sets the compared trees' depth (their k)."""
    out = tmp_path / "results.json"
    status = cli.main(
        bench_args(model_folder, prompts_file, "--method", "ngram", "--k", "2", "--num-prompts", "2",
                   "--tree", '{"static": [[0], [1], [0, 0]]}', "--tree-nodes", "6", "--tree-depth", "4",
                   "--verify-repeats", "1", "--out", str(out))
    )  # fmt: skip
    assert status == 0
    arms = json.loads(out.read_text())["arms"]
    assert list(arms) == ["plain", "transformers", "ours", "ours_tree6"]
    static = {"num_nodes": 3, "topk": 2, "depth": 2, "static": [[0], [1], [0, 0]]}
    check_tree_arm(arms["ours"], 3, static, batch_size=1, verify_tree=True)
    check_tree_arm(arms["ours_tree6"], 6, {"num_nodes": 6, "topk": 4, "depth": 4}, batch_size=1, verify_tree=True)
    assert arms["ours_tree6"]["k"] == 4 and arms["ours"]["k"] == 2
    assert max(len(arms["ours_tree6"]["accepted_length_counts"]), 1) <= 5  # at most depth 4 accepted


def test_tree_arm_names_and_configs():
    trees = ({"num_nodes": 8}, {"num_nodes": 8, "topk": 2}, {"static": [[0], [0, 0]]})
    assert tree_arm_names(trees) == ["ours_tree8_t4", "ours_tree8_t2", "ours_static2"]
    assert tree_arm_names(({"num_nodes": 8, "depth": 3}, {"num_nodes": 8, "depth": 5})) == ["ours_tree8_d3", "ours_tree8_d5"]
    assert tree_arm_names(({"num_nodes": 8}, {"num_nodes": 8})) == ["ours_tree8", "ours_tree8_1"]
    settings = BenchSettings(method="ngram", k=5, extra_config={"cpu_linear_backend": "torch"}, trees=trees)
    arms = {arm.name: arm for arm in build_arms(settings, build_tiny_llama())}
    config = arms["ours_tree8_t2"].generate_kwargs["speculative_config"]
    assert (config.tree.num_nodes, config.tree.topk, config.tree.depth, config.num_speculative_tokens) == (8, 2, 5, 5)
    assert config.cpu_linear_backend == "torch" and arms["ours"].generate_kwargs["speculative_config"].tree is None
    static = arms["ours_static2"].generate_kwargs["speculative_config"]
    assert static.num_speculative_tokens == 2 and static.tree.static_paths == ((0,), (0, 0))
    assert arms["ours_static2"].k == 2


@pytest.mark.parametrize("nodes,topk,depth", [(64, 4, 5), (8, 4, 5), (5, 1, 5), (100, 2, 3), (16, 4, 1)])
def test_verify_cost_times_the_largest_tree_the_spec_allows(nodes, topk, depth):
    parents = timing_tree(TreeSpec.parse({"num_nodes": nodes, "topk": topk, "depth": depth}, max_depth=depth))
    # EAGLE-2's most: topk children of the root, then the topk first nodes of each depth expanded into topk each
    assert len(parents) == min(nodes, topk + (depth - 1) * topk * topk)
    assert tree_depths(parents).max() <= depth and max(len(c) for c in children_of(parents)) <= topk
    static = TreeSpec.parse({"static": [[0], [1], [0, 0], [0, 1], [1, 0]]}, max_depth=2)
    assert timing_tree(static).tolist() == [-1, -1, 0, 0, 1]


@pytest.mark.parametrize(
    "extra,fragment",
    [
        (["--method", "ngram", "--tree", "{num_nodes: 3}"], "--tree='{num_nodes: 3}' is not valid JSON"),
        (["--method", "ngram", "--tree", "[[0], [1]]"], "--tree='[[0], [1]]' is not a JSON object"),
        (["--method", "suffix", "--tree", '{"num_nodes": 8}'],
         "--tree={\"num_nodes\": 8}: speculative_config.tree is not supported with method='suffix'"),
        (["--method", "ngram", "--k", "2", "--tree", '{"num_nodes": 8, "depth": 3}'],
         "--tree={\"num_nodes\": 8, \"depth\": 3}: speculative_config.tree.depth=3 is out of range"),
        (["--method", "ngram", "--k", "2", "--tree", '{"nodes": 8}'], "--tree={\"nodes\": 8}: speculative_config.tree has unknown keys"),
        (["--method", "layer_skip", "--early-exit-layer", "1", "--tree-nodes", "8"],
         "--tree-nodes=8: speculative_config.tree is not supported with method='layer_skip'"),
        (["--method", "ngram", "--tree-nodes", "8,x"], "--tree-nodes='8,x'"),
        (["--method", "ngram", "--tree-nodes", "8,300"], "--tree-nodes=8,300: speculative_config.tree.num_nodes=300"),
        (["--method", "ngram", "--tree-nodes", "8", "--tree-topk", "0"],
         "--tree-nodes=8 --tree-topk=0: speculative_config.tree.topk=0"),
        (["--method", "ngram", "--k", "auto", "--tree-nodes", "8"], "--tree-nodes with --k auto needs --tree-depth"),
        (["--method", "ngram", "--tree-topk", "2"], "give --tree-nodes too"),
        (["--method", "ngram", "--verify-repeats", "-1"], "--verify-repeats=-1"),

        (["--method", "ngram", "--top-p", "0.8"], "--top-p / --top-k: allowed only with --temperature"),
        (["--method", "ngram", "--temperature", "0.7", "--top-p", "1.5"], "--top-p=1.5: allowed: a number in (0, 1]"),
        (["--method", "ngram", "--temperature", "0.7", "--top-k", "-1"], "--top-k=-1: allowed: an integer >= 0"),
        (["--method", "ngram", "--k", "x"], "--k"),
        (["--method", "ngram", "--k", "0"], "num_speculative_tokens"),
        (["--method", "ngram", "--k", "3", "--max-speculative-tokens", "4"], "max_speculative_tokens"),
        (["--method", "layer_skip", "--k", "3"], "early_exit_layer"),
        (["--method", "ngram", "--ks", "1,two"], "--ks"),
        (["--method", "ngram", "--compare-cpu-linear-backends", "torch,blas"], "--compare-cpu-linear-backends"),
        (["--method", "suffix", "--compare-methods", "ngram,eagle3"], "--compare-methods"),
    ],
)
def test_bench_bad_arguments_exit_with_a_message(model_folder, prompts_file, capsys, extra, fragment):
    with pytest.raises(SystemExit) as info:
        cli.main(bench_args(model_folder, prompts_file, *extra))
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_bench_bad_prompts_file(model_folder, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w5 w6"}\n')
    with pytest.raises(SystemExit):
        cli.main(bench_args(model_folder, bad, "--method", "ngram"))
    assert '"prompt" or a "messages" field' in capsys.readouterr().err


def test_console_script_wiring(model_folder, prompts_file, tmp_path):
    """pyproject's console script names `hf_specdec.cli:main`, and the module runs as a program."""
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]")[1].split("\n[")[0]
    assert 'hf-specdec = "hf_specdec.cli:main"' in scripts
    out = tmp_path / "results.json"
    # layer_skip: a fresh process would spend seconds compiling the n-gram drafter's numba kernel
    args = bench_args(
        model_folder,
        prompts_file,
        "--method",
        "layer_skip",
        "--early-exit-layer",
        "1",
        "--k",
        "2",
        "--num-prompts",
        "1",
    )
    process = subprocess.run(
        [sys.executable, "-m", "hf_specdec.cli", *args, "--threads", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == 0, process.stderr
    assert json.loads(out.read_text())["arms"]["ours"]["identical_fraction"] == 1.0
    assert "x plain" in process.stdout
