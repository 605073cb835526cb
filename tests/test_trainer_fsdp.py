"""The head trainer with a sharded target (`--shard-target`) and an FSDP2-sharded head, in two real
CPU processes (gloo), against one process.

- `accelerate launch --multi_gpu --num_processes 2 ... --shard-target` (ACCELERATE_USE_CPU=true):
  the trainer's own command, the target sharded by transformers' FSDP2 plan, the head under DDP.
- `fsdp_trainer_worker.py` under torchrun: the head sharded with FSDP2 as Accelerate's FSDP2
  prepare would shard it with examples/accelerate_fsdp.yaml (Accelerate enables FSDP only on
  GPUs, so the worker applies it), trained by the trainer's own step and written by its own output
  code.

Both must train the head one process trains (the same loss and learning rate at every step, the
same fp32 weights to 1e-4), and so the same head as each other.
What stays untested here (Accelerate's own FSDP2 prepare, optimizer and checkpoints): docs/training.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_trainer
import torch
import yaml
from accelerate.utils import DistributedType
from conftest import free_port, run_launcher
from hf_specdec.trainers import eagle as trainer
from safetensors.torch import load_file

# the DDP tests' tiny target (its folder) and chats: the same fixtures
target_folder, data_file = test_trainer.target_folder, test_trainer.data_file
WORKER = Path(__file__).resolve().parent / "fsdp_trainer_worker.py"
FSDP_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "accelerate_fsdp.yaml"
LAUNCH_TIMEOUT_SECONDS = 240  # a process waiting on a collective the other never joins fails here
# batches of 2 rows (one per process); 5 held-out records evaluated in batches of 2, 2 and 1: the
# last leaves one process without a row (it runs a filler). No warmup: all 3 steps update the head.
COMMON = [
    "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "0", "--max-steps", "3", "--eval-every", "0",
    "--save-every", "0", "--report-to", "none", "--num-threads", "1", "--max-length", "64",
    "--eval-fraction", "0.1", "--max-eval-records", "5", "--save-dtype", "float32",
]  # fmt: skip
METHODS = {
    # two layers: EAGLE-3's first layer and a Llama layer after it, each its own FSDP unit
    "eagle3": ["--method", "eagle3", "--draft-vocab-size", "96", "--ttt-steps", "2", "--num-layers", "2"],
    # EAGLE scores through the target's lm_head, which the sharded target holds in shards
    "eagle": ["--method", "eagle"],
}
FSDP_UNITS = {"eagle3": ["head.layers.0", "head.layers.1"], "eagle": ["head.layers.0"]}


def _run_two_processes(command: list[str]) -> None:
    run_launcher(command, LAUNCH_TIMEOUT_SECONDS, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true")


def _trainer_args(target_folder: Path, data_file: Path, output: Path, *extra: str) -> list[str]:
    paths = ["--target", str(target_folder), "--data", str(data_file), "--output", str(output)]
    return [*paths, *COMMON, *extra]


def _launch_trainer(args: list[str]) -> None:
    _run_two_processes([
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), "-m", "hf_specdec.trainers.eagle", *args,
    ])  # fmt: skip


def _log(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / trainer.TRAIN_LOG).read_text().splitlines()]


def _assert_same_head(a: Path, b: Path) -> None:
    one, other = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert one.keys() == other.keys()
    for name in one:
        # saved in fp32: far below one AdamW step (about lr = 3e-3 per weight); measured under 1e-6
        torch.testing.assert_close(one[name], other[name], rtol=1e-4, atol=1e-4, msg=name)


def _assert_same_losses(one: list[float], other: list[float]) -> None:
    assert len(one) == len(other) == 3
    for a, b in zip(one, other):
        assert abs(a - b) < 1e-4 * max(1.0, abs(a)), (one, other)


def test_example_config_is_fsdp2_and_wraps_the_heads_own_layers():
    config = yaml.safe_load(FSDP_CONFIG.read_text())
    assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
    assert config["fsdp_config"]["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    # no class names: Accelerate takes the objective's _no_split_modules, those the head has
    assert "fsdp_transformer_layer_cls_to_wrap" not in config["fsdp_config"]


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_sharded_target_and_fsdp_head_train_the_same_head_as_one_process(
    target_folder, data_file, tmp_path, method
):
    extra = METHODS[method]
    trainer.main(_trainer_args(target_folder, data_file, tmp_path / "one", *extra))
    _launch_trainer(_trainer_args(target_folder, data_file, tmp_path / "ddp", *extra, "--shard-target"))
    case = {
        "trainer_args": _trainer_args(target_folder, data_file, tmp_path / "fsdp", *extra),
        "config": str(FSDP_CONFIG),
        "result": str(tmp_path / "fsdp.json"),
    }
    (tmp_path / "case.json").write_text(json.dumps(case))
    _run_two_processes([
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(WORKER), str(tmp_path / "case.json"),
    ])  # fmt: skip
    fsdp = json.loads((tmp_path / "fsdp.json").read_text())

    # two processes, each holding half of the target's and of the head's weights
    ddp_state = json.loads((tmp_path / "ddp" / "trainer_state.json").read_text())
    assert ddp_state["num_processes"] == 2 and fsdp["world_size"] == 2
    assert fsdp["distributed_type"] == "MULTI_CPU"  # gloo; the FSDP2 units are the worker's own
    assert sorted(fsdp["units"]) == FSDP_UNITS[method]
    for weight in (fsdp["target_q_proj_rows"], fsdp["head_q_proj_rows"]):
        assert weight["sharded"] and weight["local_rows"] * 2 == weight["rows"]

    one_log, ddp_log = _log(tmp_path / "one"), _log(tmp_path / "ddp")
    one_losses = [r["loss"] for r in one_log if "loss" in r]
    _assert_same_losses(one_losses, [r["loss"] for r in ddp_log if "loss" in r])
    _assert_same_losses(one_losses, fsdp["losses"])
    one_rates = [r["lr"] for r in one_log if "lr" in r]
    assert one_rates == [r["lr"] for r in ddp_log if "lr" in r] == fsdp["lr"]
    # the held-out evaluation, whose last batch left the second process a filler row
    one_eval, ddp_eval = one_log[-1], ddp_log[-1]
    assert one_eval["eval/loss"] == pytest.approx(ddp_eval["eval/loss"], rel=1e-4)
    assert one_eval["eval/simulated_tau"] == pytest.approx(ddp_eval["eval/simulated_tau"], rel=1e-4)
    _assert_same_head(tmp_path / "one", tmp_path / "ddp")
    _assert_same_head(tmp_path / "one", tmp_path / "fsdp")
    _assert_same_head(tmp_path / "ddp", tmp_path / "fsdp")


def test_sharded_target_fills_the_hidden_states_cache_as_one_process(target_folder, data_file, tmp_path):
    # 5 held-out records over 2 processes in batches of 2: 2 target forwards on the first, 1 on the
    # second, which runs a filler forward so that both join the same collectives
    extra = ["--method", "eagle"]
    trainer.main(_trainer_args(target_folder, data_file, tmp_path / "one", *extra,
                               "--hidden-states-cache", str(tmp_path / "cache_one")))
    _launch_trainer(_trainer_args(target_folder, data_file, tmp_path / "two", *extra, "--shard-target",
                                  "--hidden-states-cache", str(tmp_path / "cache_two")))
    for split, records in (("train", 58), ("eval", 5)):
        one_states, two_states = (
            {name: tensor for shard in sorted((tmp_path / cache / split).glob("*.safetensors"))
             for name, tensor in load_file(str(shard)).items()}
            for cache in ("cache_one", "cache_two")
        )  # fmt: skip
        assert len(one_states) == len(two_states) == 2 * records  # features and final hidden states
        assert len(list((tmp_path / "cache_two" / split).glob("*.safetensors"))) == 2  # one shard per process
        for name, tensor in one_states.items():
            # the sharded target's forward against the whole one's, both stored in bf16 (equal here)
            torch.testing.assert_close(two_states[name], tensor, msg=name)
    _assert_same_losses(*([r["loss"] for r in _log(tmp_path / run) if "loss" in r] for run in ("one", "two")))
    _assert_same_head(tmp_path / "one", tmp_path / "two")


def test_shard_target_and_fsdp1_are_refused_with_what_works(target_folder, data_file, tmp_path):
    with pytest.raises(
        ValueError, match="--shard-target shards the target over the processes, and this run has one"
    ):
        trainer.main(_trainer_args(target_folder, data_file, tmp_path / "bad", "--shard-target"))
    fsdp1 = SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False, num_processes=2)
    with pytest.raises(ValueError, match="FSDP version 1 is not supported.*fsdp_version: 2"):
        trainer.check_distributed_setup(fsdp1, shard_target=False)
    deepspeed = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, is_fsdp2=False, num_processes=2)
    trainer.check_distributed_setup(deepspeed, shard_target=False)  # the flag is what DeepSpeed cannot take
    with pytest.raises(ValueError, match="--shard-target does not work under DEEPSPEED"):
        trainer.check_distributed_setup(deepspeed, shard_target=True)
