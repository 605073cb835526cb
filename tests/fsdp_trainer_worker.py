"""Train a head the way `hf_specdec.trainers.eagle` does, its head sharded with FSDP2 (run by
tests/test_trainer_fsdp.py under `torchrun --nproc-per-node 2`, gloo, ACCELERATE_USE_CPU=true).

Accelerate turns FSDP on only for GPU launches, so on CPU this worker shards the head where
Accelerate's FSDP2 `prepare` would with examples/accelerate_fsdp.yaml: a plugin built from the
file's settings picks the units with Accelerate's own TRANSFORMER_BASED_WRAP code (from the
objective's `_no_split_modules`), torch's `fully_shard` shards them and then the root. The rest of
Accelerate's prepare (its optimizer and mixed-precision handling) does not run. Everything else is
the trainer's own functions: the target loaded sharded (`--shard-target`), the head built from it,
the batches, `share_of`, `train_step` (loss over all processes, backward, Accelerate's clipping,
optimizer and scheduler steps), `gathered_state_dict` and `head_from_state` for the output.

    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_trainer_worker.py CASE.json

CASE.json: {"trainer_args": [...], "config": "<accelerate yaml>", "result": "<json path>"}; the
head is written to the trainer args' --output, in --save-dtype.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, set_seed
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up
from hf_specdec.trainers import eagle as trainer
from hf_specdec.trainers.data import length_grouped_batches, load_records, split_train_eval, tokenize_records
from hf_specdec.trainers.objectives import DraftTrainingObjective
from hf_specdec.trainers.target_states import run_target
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import get_cosine_schedule_with_warmup

from hf_specdec.models.feature_capture import decoder_parts


def shard_as_accelerate_would(objective: torch.nn.Module, fsdp_config: dict) -> list[str]:
    """FSDP2 units as Accelerate's `fsdp2_prepare_model` makes them from this config: the modules
    its auto-wrap policy picks (bottom up), then the root. Returns the units' names."""
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=fsdp_config["fsdp_version"],
        auto_wrap_policy=fsdp_config["fsdp_auto_wrap_policy"],
        reshard_after_forward=fsdp_config["fsdp_reshard_after_forward"],
    )
    plugin.set_auto_wrap_policy(objective)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, objective)
    names = {module: name for name, module in objective.named_modules()}
    units = []
    for module in get_module_children_bottom_up(objective)[:-1]:
        if policy(module):
            fully_shard(module, reshard_after_forward=plugin.reshard_after_forward)
            units.append(names[module])
    fully_shard(objective)
    return units


def rows_here(weight: torch.Tensor) -> dict:
    """A weight's rows in all, and on this process (its shard, when FSDP2 holds it as a DTensor)."""
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return {"sharded": isinstance(weight, DTensor), "rows": weight.shape[0], "local_rows": local.shape[0]}


def main(case_path: str) -> None:
    case = json.loads(Path(case_path).read_text())
    args = trainer.parse_args(case["trainer_args"])
    fsdp_config = yaml.safe_load(Path(case["config"]).read_text())["fsdp_config"]
    torch.set_num_threads(args.num_threads or 1)
    accelerator = Accelerator(step_scheduler_with_optimizer=False)
    set_seed(args.seed)
    target, tokenizer = trainer.load_target(args.target, False, shard_over=accelerator.num_processes)
    data = tokenize_records(load_records(args.data), tokenizer, args.max_length)
    train_ids, _ = split_train_eval(len(data), args.eval_fraction, args.eval_seed)
    train_data = data.subset(train_ids)
    head = trainer.build_head(args, target, train_data)
    feature_layers = head.feature_layers_for(len(decoder_parts(target)[0]))
    objective = DraftTrainingObjective(
        head, num_steps=args.ttt_steps, step_weight=args.step_weight, target_matmul_dtype=target.dtype
    )
    units = shard_as_accelerate_would(objective, fsdp_config)
    optimizer = torch.optim.AdamW(objective.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    warmup = min(args.warmup_steps, args.max_steps)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, args.max_steps)

    lengths = [len(ids) for ids in train_data.input_ids]
    losses, rates = [], []
    for indices in length_grouped_batches(lengths, args.batch_size, args.seed, 0)[: args.max_steps]:
        batch = trainer.share_of(accelerator, train_data, indices)
        states = run_target(target, batch.input_ids, feature_layers)
        loss, _ = trainer.train_step(accelerator, objective, optimizer, scheduler, batch, states,
                                     target.get_output_embeddings(), args.max_grad_norm)
        losses.append(loss)
        rates.append(scheduler.get_last_lr()[0])

    state = trainer.gathered_state_dict(objective)  # every process: a collective
    if accelerator.is_main_process:
        head_state = {name.removeprefix("head."): tensor for name, tensor in state.items()}
        saved = trainer.head_from_state(head.head_config, head_state, getattr(torch, args.save_dtype))
        saved.save_pretrained(args.output)
        result = {
            "world_size": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type.value),
            "units": units,
            "losses": losses,
            "lr": rates,
            "target_q_proj_rows": rows_here(target.model.layers[0].self_attn.q_proj.weight),
            "head_q_proj_rows": rows_here(objective.head.layers[0].self_attn.q_proj.weight),
        }
        Path(case["result"]).write_text(json.dumps(result))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
