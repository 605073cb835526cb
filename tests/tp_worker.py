"""Run by test_tensor_parallel.py, as a script under `torchrun --nproc-per-node 2` (gloo, CPU):

    python -m torch.distributed.run --nproc-per-node 2 tests/tp_worker.py CASE.json

CASE.json (written by the test) names the model folders, the inputs, the speculative configs and
the single-process reference tokens. Each rank loads the target sharded by transformers' tensor
parallelism, runs every check and writes `rank<N>.json` next to CASE.json: per check its tokens
and metrics, or the error it raised, so the test can say which check failed on which rank.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from unittest.mock import patch

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import hf_specdec
from hf_specdec.drafters.draft_model import load_draft_model
from hf_specdec.loop.auto_k import AutoKController
from hf_specdec.loop.auto_tree import AutoTreeController
from hf_specdec.models.cpu_linear import resolve_backend
from hf_specdec.profiling import StepTimer

# a rank that fails alone leaves the other waiting in a collective: give up after this, not after hours
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# the 1-kv-head model cannot split its one K/V head over 2 ranks: each rank holds a copy of it
ONE_KV_HEAD_PLAN = {"model.layers.*.self_attn.k_proj": "unit_colwise", "model.layers.*.self_attn.v_proj": "unit_colwise"}
METRICS_KEPT = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_target_forwards", "num_emitted_tokens")


def main(case_path: Path) -> None:
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    case = json.loads(case_path.read_text())
    rank = dist.get_rank()
    torch.set_num_threads(1)
    target = load_sharded(case["target"])
    hf_specdec.enable(target)
    inputs = {name: torch.tensor(value) for name, value in case["inputs"].items()}
    result: dict = {"rank": rank, "world_size": dist.get_world_size()}

    result["layout"] = run_check(lambda: layout(target, case))
    result["greedy"] = {
        name: run_check(lambda config=config: greedy(target, inputs, case["max_new_tokens"], config))
        for name, config in case["drafters"].items()
    }
    # torch's own generator differs between the ranks: the speculative seed alone must make them agree
    torch.manual_seed(1000 + rank)
    result["sampled"] = {
        name: run_check(lambda name=name: sampled(target, inputs, case["max_new_tokens"], case["drafters"][name]))
        for name in case["sampled"]
    }
    result["engine"] = {
        name: run_check(lambda name=name: engine_requests(target, case["drafters"][name], case["engine_requests"]))
        for name in case["engine"]
    }
    ngram = case["drafters"]["ngram"]
    result["timed_choices"] = {
        "generate_auto_k": run_check(lambda: timed_choices(rank, AutoKController, lambda: greedy(
            target, inputs, case["max_new_tokens"], {**ngram, "num_speculative_tokens": "auto"}
        ))),  # fmt: skip
        "engine_auto_tree": run_check(lambda: timed_choices(rank, AutoTreeController, lambda: engine_requests(
            target, {**ngram, "num_speculative_tokens": 3, "tree": "auto"}, case["engine_requests"]
        ))),  # fmt: skip
    }
    result["disagreeing"] = {
        "prompts": run_check(lambda: disagreeing_prompts(target, inputs, rank)),
        "seeds": run_check(lambda: disagreeing_seeds(target, inputs, rank)),
    }
    one_kv_head = load_sharded(case["one_kv_head"], tp_plan=ONE_KV_HEAD_PLAN)
    hf_specdec.enable(one_kv_head)
    result["one_kv_head"] = {
        "layout": run_check(lambda: attention_layout(one_kv_head)),
        "greedy": run_check(lambda: greedy(one_kv_head, inputs, case["max_new_tokens"], case["drafters"]["ngram"])),
    }
    (case_path.parent / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def load_sharded(folder: str, tp_plan: dict[str, str] | None = None):
    config = DistributedConfig(tp_size=dist.get_world_size(), tp_plan=tp_plan)
    return AutoModelForCausalLM.from_pretrained(folder, distributed_config=config).eval()


def run_check(check: Callable[[], object]) -> dict:
    """{"value": what the check returned} or {"error": "Type: message", "traceback": ...}."""
    try:
        value = check()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
    return {"value": value if isinstance(value, (dict, list, str, int, float, bool)) else None}


def attention_layout(model) -> dict:
    """Global and local (this rank's) rows of layer 0's q / k / v weights."""
    attention = model.model.layers[0].self_attn
    return {
        name: {
            "global": list(getattr(attention, name).weight.shape),
            "local": list(getattr(attention, name).weight.to_local().shape),
        }
        for name in ("q_proj", "k_proj", "v_proj")
    }


def layout(target, case: dict) -> dict:
    draft = load_draft_model(case["drafters"]["draft_model"]["model"], target)
    return {
        "attention": attention_layout(target),
        "lm_head_is_dtensor": type(target.lm_head.weight).__name__ == "DTensor",
        # "auto" would time the draft's linear routes on each rank: under tensor parallelism it is torch's
        "linear_backend": resolve_backend("auto", [target, draft]),
        "draft_linear_backend_alone": resolve_backend("auto", [draft]),
    }


def greedy(model, inputs: dict, max_new_tokens: int, config: dict) -> dict:
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True, speculative_config=config
    )
    return {"sequences": out.sequences.tolist(), "metrics": {k: out.spec_metrics[k] for k in METRICS_KEPT}}


def sampled(model, inputs: dict, max_new_tokens: int, config: dict) -> dict:
    """This rank's sampled sequences and every rank's (all_gather), padded to one width with -1."""
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=True, speculative_config={**config, "seed": 7}
    )
    width = inputs["input_ids"].shape[1] + max_new_tokens
    padded = torch.full((out.shape[0], width), -1, dtype=out.dtype)
    padded[:, : out.shape[1]] = out
    gathered = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, padded)
    return {"sequences": padded.tolist(), "every_rank": [g.tolist() for g in gathered]}


def engine_requests(model, config: dict, requests: list[dict]) -> dict:
    """Requests join the running batch at their `join_step`; each one's tokens and finish reason."""
    engine = hf_specdec.SpeculativeEngine(model, config, max_batch_size=4, max_model_len=128)
    finished: dict[str, dict] = {}
    for step in range(500):
        for request in requests:
            if request["join_step"] == step:
                engine.add_request(
                    request["prompt"], {"max_new_tokens": request["max_new_tokens"], "do_sample": False},
                    request_id=request["id"],
                )  # fmt: skip
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = {
                    "token_ids": output.token_ids, "finish_reason": output.finish_reason, "error": output.error
                }
        if step >= max(r["join_step"] for r in requests) and not engine.has_unfinished():
            break
    pool_kv_heads = engine.cache.layers[0].keys.shape[2]  # [blocks, block_size, heads, head_dim]
    engine.close()
    return {"requests": finished, "pool_kv_heads": pool_kv_heads, "draft_tokens": engine.metrics.num_draft_tokens}


def timed_choices(rank: int, controller: type, run: Callable[[], dict]) -> dict:
    """`run` (auto k or auto trees) with rank 1's clock running 3x slow; its result, and each step the
    controller recorded: (seconds, k or tree size)."""
    steps = []
    elapsed, record_step = StepTimer.elapsed, controller.record_step

    def slow_clock(timer: StepTimer) -> float:
        return elapsed(timer) * (3 if rank == 1 else 1)

    def recorded(self, *args):
        seconds, choice = (args[0], args[1]) if controller is AutoKController else (args[2], args[1])
        steps.append((seconds, choice))
        return record_step(self, *args)

    with patch.object(StepTimer, "elapsed", slow_clock), patch.object(controller, "record_step", recorded):
        return {**run(), "steps": steps}


def disagreeing_prompts(model, inputs: dict, rank: int) -> str:
    """Rank 1 changes one prompt token: both ranks must raise before the forward mixes them."""
    input_ids = inputs["input_ids"].clone()
    input_ids[0, -1] = 3 + (input_ids[0, -1] + rank) % 100
    model.generate(
        input_ids=input_ids, attention_mask=inputs["attention_mask"], max_new_tokens=6, do_sample=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )  # fmt: skip
    return "no error"


def disagreeing_seeds(model, inputs: dict, rank: int) -> str:
    """Each rank samples with its own seed: the next forward's tokens differ, and both ranks raise."""
    model.generate(
        **inputs, max_new_tokens=12, do_sample=True, temperature=2.0, top_k=0,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "seed": rank},
    )  # fmt: skip
    return "no error"


if __name__ == "__main__":
    main(Path(sys.argv[1]))
