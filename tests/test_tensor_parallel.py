"""Tensor parallelism: a target sharded by transformers over two CPU processes (`torchrun
--nproc-per-node 2`, gloo) speculates to the tokens of one process.

One launch of `tp_worker.py` loads the tiny Llama sharded on both ranks and runs every check
there; this process saves the models, computes the single-process references from the same
folders, hands both over in a JSON file and asserts on each rank's JSON results, one test per
check. See docs/tensor-parallel.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    EOS_TOKEN_ID,
    build_tiny_llama,
    free_port,
    left_padded_batch,
    plain_generate,
    repeated_span_prompts,
    run_launcher,
)
from test_draft_model import perturbed_copy
from test_eagle import random_head
from transformers import AutoModelForCausalLM

WORKER = Path(__file__).resolve().parent / "tp_worker.py"
RANKS = 2
MAX_NEW_TOKENS = 24
LAUNCH_TIMEOUT_SECONDS = 300
SAMPLED = ("ngram", "draft_model")
ENGINE = ("ngram", "draft_model")
# drafters that guess this text (the random EAGLE-3 head and the 1-layer early exit may not):
# the target runs fewer forwards than it emits tokens
ACCEPTING = ("ngram", "draft_model", "suffix")
# (request id, join step, max_new_tokens): the later ones join a batch that is already decoding
ENGINE_REQUESTS = (("a", 0, 14), ("b", 2, 22), ("c", 4, 9))


def drafter_configs(folder: Path) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "model": str(folder / "draft"), "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": str(folder / "eagle3_head"), "num_speculative_tokens": 3},
        "layer_skip": {"method": "layer_skip", "early_exit_layer": 1, "num_speculative_tokens": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    }


def _greedy_reference(folder: Path, inputs: dict) -> list[list[int]]:
    """Plain generate() in this one process, on the model loaded back from the folder the ranks load."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return plain_generate(model, **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False).tolist()


def _write_case(folder: Path) -> dict:
    target = build_tiny_llama()
    target.save_pretrained(folder / "target")
    perturbed_copy(target).save_pretrained(folder / "draft")
    random_head(target, "eagle3").save_pretrained(folder / "eagle3_head")
    build_tiny_llama(num_key_value_heads=1).save_pretrained(folder / "one_kv_head")

    inputs = left_padded_batch(repeated_span_prompts(3, seed=4))
    reference_model = AutoModelForCausalLM.from_pretrained(folder / "target").eval()
    engine_requests = []
    for (request_id, join_step, max_new_tokens), prompt in zip(ENGINE_REQUESTS, repeated_span_prompts(3, seed=9)):
        alone = plain_generate(
            reference_model, input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False
        )
        engine_requests.append({
            "id": request_id, "join_step": join_step, "max_new_tokens": max_new_tokens, "prompt": prompt,
            "reference": alone[0, len(prompt) :].tolist(),
        })  # fmt: skip
    case = {
        "target": str(folder / "target"),
        "one_kv_head": str(folder / "one_kv_head"),
        "inputs": {name: value.tolist() for name, value in inputs.items()},
        "max_new_tokens": MAX_NEW_TOKENS,
        "drafters": drafter_configs(folder),
        "sampled": list(SAMPLED),
        "engine": list(ENGINE),
        "engine_requests": engine_requests,
        "reference": _greedy_reference(folder / "target", inputs),
        "one_kv_head_reference": _greedy_reference(folder / "one_kv_head", inputs),
    }
    (folder / "case.json").write_text(json.dumps(case))
    return case


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[dict, list[dict]]:
    """(the case, each rank's results) from one torchrun launch of the worker."""
    folder = tmp_path_factory.mktemp("tensor_parallel")
    case = _write_case(folder)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(WORKER), str(folder / "case.json"),
    ]  # fmt: skip
    run_launcher(command, LAUNCH_TIMEOUT_SECONDS, OMP_NUM_THREADS="1")
    results = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
    assert [r["rank"] for r in results] == list(range(RANKS)) and {r["world_size"] for r in results} == {RANKS}
    return case, results


def _value(check: dict, rank: int, name: str):
    assert "error" not in check, f"rank {rank}, {name}: {check['error']}\n{check['traceback']}"
    return check["value"]


def test_weights_are_sharded_and_the_loop_runs_torch_linears(launch):
    _, results = launch
    for rank, result in enumerate(results):
        layout = _value(result["layout"], rank, "layout")
        # 4 query heads / 2 kv heads of 16 dims: each rank holds half of each
        assert layout["attention"] == {
            "q_proj": {"global": [64, 64], "local": [32, 64]},
            "k_proj": {"global": [32, 64], "local": [16, 64]},
            "v_proj": {"global": [32, 64], "local": [16, 64]},
        }
        assert layout["lm_head_is_dtensor"]
        # the draft alone would get timed routes; next to a sharded target every rank runs torch's
        assert (layout["draft_linear_backend_alone"], layout["linear_backend"]) == ("auto", "torch")


@pytest.mark.parametrize("method", list(drafter_configs(Path())))
def test_greedy_speculation_matches_one_process(launch, method):
    case, results = launch
    for rank, result in enumerate(results):
        run = _value(result["greedy"][method], rank, method)
        assert run["sequences"] == case["reference"], f"rank {rank}, {method}"
        metrics = run["metrics"]
        assert metrics["num_draft_tokens"] > 0, metrics
        if method in ACCEPTING:
            assert metrics["num_accepted_tokens"] > 0 and metrics["num_target_forwards"] < MAX_NEW_TOKENS, metrics


@pytest.mark.parametrize("method", SAMPLED)
def test_sampled_speculation_agrees_across_ranks(launch, method):
    """Same speculative seed, different torch.manual_seed per rank: the ranks sample the same tokens."""
    case, results = launch
    runs = [_value(result["sampled"][method], rank, method) for rank, result in enumerate(results)]
    assert runs[0]["sequences"] == runs[1]["sequences"]
    assert runs[0]["every_rank"] == runs[1]["every_rank"] == [runs[0]["sequences"]] * RANKS
    width = len(case["inputs"]["input_ids"][0])
    assert [row[:width] for row in runs[0]["sequences"]] == case["inputs"]["input_ids"]
    # it sampled: the first new tokens are not all greedy's
    assert [row[width : width + 4] for row in runs[0]["sequences"]] != [row[width : width + 4] for row in case["reference"]]


@pytest.mark.parametrize("method", ENGINE)
def test_engine_requests_joining_mid_flight_match_one_process(launch, method):
    case, results = launch
    for rank, result in enumerate(results):
        run = _value(result["engine"][method], rank, f"engine {method}")
        for request in case["engine_requests"]:
            got = run["requests"][request["id"]]
            assert got["error"] is None, f"rank {rank}, request {request['id']}: {got['error']}"
            assert got["token_ids"] == request["reference"], f"rank {rank}, {method}, request {request['id']}"
            assert got["finish_reason"] == ("stop" if got["token_ids"][-1] == EOS_TOKEN_ID else "length")
        assert run["draft_tokens"] > 0
        assert run["pool_kv_heads"] == 1  # the paged pool holds this rank's kv heads only (2 / 2 ranks)


def test_one_kv_head_with_unit_colwise_keys_and_values(launch):
    case, results = launch
    for rank, result in enumerate(results):
        layout = _value(result["one_kv_head"]["layout"], rank, "one kv head layout")
        assert layout["q_proj"] == {"global": [64, 64], "local": [32, 64]}
        assert layout["k_proj"] == layout["v_proj"] == {"global": [16, 64], "local": [16, 64]}  # a copy per rank
        run = _value(result["one_kv_head"]["greedy"], rank, "one kv head greedy")
        assert run["sequences"] == case["one_kv_head_reference"], f"rank {rank}"
        assert run["metrics"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("check", ["generate_auto_k", "engine_auto_tree"])
def test_choices_timed_per_rank_agree(launch, check):
    """Auto k (generate) and auto trees (engine) with rank 1's clock running 3x slow: the ranks take
    the slowest rank's time for each step, so their controllers record the same seconds and make the
    same choices, and the tokens are one process's."""
    case, results = launch
    runs = [_value(result["timed_choices"][check], rank, check) for rank, result in enumerate(results)]
    assert runs[0]["steps"] == runs[1]["steps"] and len(runs[0]["steps"]) > 3
    assert len({choice for _, choice in runs[0]["steps"]}) > 1 or check == "engine_auto_tree"
    for rank, run in enumerate(runs):
        if check == "generate_auto_k":
            assert run["sequences"] == case["reference"], f"rank {rank}"
        else:
            for request in case["engine_requests"]:
                assert run["requests"][request["id"]]["token_ids"] == request["reference"], f"rank {rank}"


@pytest.mark.parametrize("check", ["prompts", "seeds"])
def test_ranks_that_disagree_raise_on_every_rank(launch, check):
    _, results = launch
    for rank, result in enumerate(results):
        error = result["disagreeing"][check].get("error")
        assert error is not None and error.startswith("RuntimeError: tensor-parallel ranks disagree"), f"rank {rank}: {error}"
