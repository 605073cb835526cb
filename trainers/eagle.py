"""Train an EAGLE or EAGLE-3 draft head for any Llama-style Hugging Face causal LM.

    accelerate launch -m hf_specdec.trainers.eagle --target <folder|Hub id> --data <file|Hub id> \\
        --output <folder> --method eagle3 [--ttt-steps 7] [--max-steps N] ...
    python -m hf_specdec.trainers.eagle ...          # the same on one process

One step: the frozen target's hidden states for a global batch (online, or from
`--hidden-states-cache`), the unrolled draft steps and their loss (`objectives.py`), one
optimizer step. Each process takes its share of the global batch's rows; losses are normalised
by the label count over all processes, so 1 and N processes train the same head up to
floating-point noise. `--shard-target` shards the frozen target over the processes (FSDP2, for a
target that does not fit one device); an Accelerate FSDP2 config (examples/accelerate_fsdp.yaml)
shards the head too. Checkpoints (`accelerator.save_state`: head, optimizer, scheduler, RNG and
our progress counter) land in `<output>/checkpoints/step_N`; `--resume` continues from the
newest, in the same data order (batches are a pure function of seed and epoch).

The output folder is what `speculative_config={"method": ..., "model": <folder>}` loads:
config.json, model.safetensors, README.md (model card), plus trainer_state.json.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hf_specdec.heads.eagle_heads import EagleHead, load_eagle_head
from hf_specdec.heads.hub import head_card_fields, push_head_folder
from hf_specdec.heads.model_card import write_model_card
from hf_specdec.models.feature_capture import decoder_parts

from .data import (
    Batch,
    TokenizedData,
    collate,
    length_grouped_batches,
    load_records,
    split_train_eval,
    tokenize_records,
)
from .draft_vocab import frequent_tokens
from .objectives import DraftTrainingObjective, TargetBatch, full_weight
from .target_states import OfflineTargetStates, run_target

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch import nn
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from hf_specdec.heads.head_config import EagleHeadConfig

CHECKPOINTS = "checkpoints"
TRAIN_LOG = "train_log.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hf_specdec.trainers.eagle", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="target model: a local folder or a Hub id")
    parser.add_argument("--data", required=True, help="conversations: a .json / .jsonl / .parquet file or a Hub dataset id")
    parser.add_argument("--data-split", default="train", help="split of a Hub dataset")
    parser.add_argument("--output", required=True, help="folder for the trained head, its card and checkpoints")
    parser.add_argument("--method", choices=("eagle", "eagle3"), default="eagle3")
    parser.add_argument("--init-from", default=None, metavar="HEAD",
                        help="start from this trained head (folder or Hub id) instead of a random one; its layers "
                        "and draft vocabulary are kept (--draft-vocab-size must match or be left out); a larger "
                        "--num-layers appends layers that start as the identity")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="decoder layers in the head (default 1, or --init-from's)")
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="EAGLE-3: size of the draft vocabulary (default 32000)")
    parser.add_argument("--ttt-steps", type=int, default=None, help="unrolled draft steps (default: 7 for eagle3, 1 for eagle)")
    parser.add_argument("--step-weight", type=float, default=0.8, help="loss weight of unrolled step j is step_weight**j")
    parser.add_argument("--max-length", type=int, default=2048, help="tokens per conversation (longer ones are cut)")
    parser.add_argument("--max-records", type=int, default=None, help="use only the first N records")
    parser.add_argument("--batch-size", type=int, default=8, help="conversations per optimizer step, over all processes")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--num-epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps in total")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--eval-fraction", type=float, default=0.02, help="records held out for evaluation")
    parser.add_argument("--eval-seed", type=int, default=0,
                        help="seed of the held-out split, apart from --seed: runs that continue a head with "
                        "another data order (--init-from, another --seed) hold out the same records")
    parser.add_argument("--eval-every", type=int, default=200, help="steps between held-out evaluations (0: only at the end)")
    parser.add_argument("--max-eval-records", type=int, default=128)
    parser.add_argument("--save-every", type=int, default=200, help="steps between checkpoints (0: none)")
    parser.add_argument("--keep-checkpoints", type=int, default=2)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    parser.add_argument("--hidden-states-cache", default=None, help="folder of an offline hidden-states cache (built when missing)")
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default="no", help="for the head's training")
    parser.add_argument("--target-precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="the frozen target's forward and label logits: fp32, or autocast to bf16 / fp16 (its "
                        "weights stay fp32); on a CPU with AMX bf16 ran the target 3x faster")
    parser.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--report-to", choices=("auto", "none", "tensorboard"), default="auto",
                        help="Accelerate tracker; auto = TensorBoard when installed")
    parser.add_argument("--base-model", default=None, help="the target's Hub id for the model card (default: --target)")
    parser.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="upload the finished folder to this Hub repo")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modelling code to run")
    parser.add_argument("--shard-target", action="store_true",
                        help="shard the frozen target's weights over all processes (FSDP2 through "
                        "transformers' DistributedConfig), for a target that does not fit one device; "
                        "needs 2 or more processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads per process")
    args = parser.parse_args(argv)
    if args.ttt_steps is None:
        args.ttt_steps = 7 if args.method == "eagle3" else 1
    if args.method == "eagle" and args.draft_vocab_size is not None:
        parser.error("--draft-vocab-size is for --method eagle3; EAGLE heads draft over the target's whole vocabulary")
    minimums = {"num_layers": 1, "draft_vocab_size": 1, "ttt_steps": 1, "max_length": 2, "batch_size": 1, "num_epochs": 1, "max_steps": 1,
                "max_records": 1, "max_eval_records": 1, "warmup_steps": 0, "eval_every": 0, "save_every": 0,
                "keep_checkpoints": 0, "seed": 0, "eval_seed": 0, "num_threads": 1}
    for name, minimum in minimums.items():
        value = getattr(args, name)
        if value is not None and value < minimum:
            parser.error(f"--{name.replace('_', '-')}={value} is invalid; allowed: an integer >= {minimum}")
    for name in ("lr", "step_weight", "max_grad_norm"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid; allowed: a number > 0")
    if args.weight_decay < 0:
        parser.error(f"--weight-decay={args.weight_decay} is invalid; allowed: a number >= 0")
    args.command = " ".join(["python -m hf_specdec.trainers.eagle", *(argv if argv is not None else sys.argv[1:])])
    return args


@dataclass
class TrainingProgress:
    """Our part of a checkpoint (Accelerate saves objects with state_dict / load_state_dict)."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def load_target(
    source: str, trust_remote_code: bool, shard_over: int = 1
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The frozen target and its tokenizer. `shard_over` > 1 (the number of processes): transformers
    loads it sharded with FSDP2, each process holding 1/N of every weight on its own device, the
    weights gathered layer by layer in the forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sharding = {}
    if shard_over > 1:
        from transformers.distributed import DistributedConfig

        sharding["distributed_config"] = DistributedConfig(fsdp_size=shard_over)
    target = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=trust_remote_code, **sharding)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    target.requires_grad_(False)
    return target.eval(), tokenizer


def build_head(args: argparse.Namespace, target: PreTrainedModel, train_data: TokenizedData) -> EagleHead:
    if args.init_from is not None:
        return _head_to_continue(args, target)
    num_layers = args.num_layers or 1
    vocab_size = target.get_output_embeddings().weight.shape[0]
    draft_vocab = None
    if args.method == "eagle3":
        draft_vocab = frequent_tokens(train_data, min(args.draft_vocab_size or 32000, vocab_size), vocab_size)
    head = EagleHead.for_target(target, args.method, num_layers=num_layers, draft_vocab=draft_vocab, seed=args.seed)
    if args.method == "eagle3":
        # start the draft lm_head from the target's rows for those tokens: the head's output lives
        # in the space of the target's hidden states, and this is a far better start than noise
        with torch.no_grad():
            rows = torch.as_tensor(draft_vocab, dtype=torch.long)
            target_rows = full_weight(target.get_output_embeddings())[rows]
            head.lm_head.weight.copy_(target_rows.to(head.lm_head.weight.dtype))
    return head.train()


def _head_to_continue(args, target) -> EagleHead:
    """--init-from: a trained head (e.g. one from the Hub, or an earlier run's output folder) to train
    further on new data. Architecture and draft vocabulary are the head's own, except that
    `--num-layers` may add decoder layers (`deepen_head`); asking for anything else is an error
    rather than silently ignored."""
    head = load_eagle_head(args.init_from, target, method=args.method)
    have_layers = head.head_config.num_layers
    if args.num_layers is not None and args.num_layers < have_layers:
        raise ValueError(
            f"--num-layers={args.num_layers} is fewer than --init-from {args.init_from!r} has ({have_layers}); "
            f"allowed: an integer >= {have_layers} (layers are added, never dropped) or leave it out"
        )
    vocab = head.head_config.draft_vocab_size
    if args.draft_vocab_size is not None and args.draft_vocab_size != vocab:
        raise ValueError(
            f"--draft-vocab-size={args.draft_vocab_size} does not match --init-from {args.init_from!r}, which has "
            f"{vocab}; allowed: {vocab} or leave it out"
        )
    if args.num_layers is not None and args.num_layers > have_layers:
        head = deepen_head(head, args.num_layers, target, seed=args.seed)
    return head.train()


def deepen_head(head: EagleHead, num_layers: int, target: PreTrainedModel, seed: int) -> EagleHead:
    """`head` with decoder layers appended up to `num_layers`, each starting as the identity.

    A new layer's attention `o_proj` and MLP `down_proj` start at zero (weights, and biases where
    the target's config has them), so both of its residual branches add nothing and the deeper head drafts exactly as `head` does; the zeroed matrices
    still get gradients (their inputs are not zero), so training grows the layers from there. This
    adds capacity to a trained head without throwing away what it has learned.
    """
    config = copy.deepcopy(head.head_config)
    config.decoder.num_hidden_layers = num_layers
    with torch.random.fork_rng(devices=[]):  # reproducible new layers, the caller's RNG untouched
        torch.manual_seed(seed)
        deeper = EagleHead(config)
    missing, unexpected = deeper.load_state_dict(head.state_dict(), strict=False)
    new_layer_names = tuple(f"layers.{i}." for i in range(head.head_config.num_layers, num_layers))
    if unexpected or not all(name.startswith(new_layer_names) for name in missing):
        raise RuntimeError(f"deepening the head lost weights: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for layer in deeper.layers[head.head_config.num_layers :]:
            for output_projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                output_projection.weight.zero_()
                if output_projection.bias is not None:
                    output_projection.bias.zero_()
    return deeper.to(dtype=head.fc.weight.dtype, device=head.fc.weight.device).bind_target(target)


def reduce_sum(accelerator: Accelerator, value: torch.Tensor) -> torch.Tensor:
    return accelerator.reduce(value.detach().clone(), reduction="sum") if accelerator.num_processes > 1 else value.detach()


def check_distributed_setup(accelerator: Accelerator, shard_target: bool) -> None:
    """Refuse what the trainer cannot run, saying what would work."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ValueError(
            "FSDP version 1 is not supported: the trainer gathers the head's FSDP2 shards to save it; "
            "allowed: fsdp_version: 2 in the Accelerate config (examples/accelerate_fsdp.yaml)"
        )
    if not shard_target:
        return
    if accelerator.num_processes < 2:
        raise ValueError(
            "--shard-target shards the target over the processes, and this run has one; allowed: a launch of "
            "2 or more processes (accelerate launch --num_processes N ..., see docs/training.md)"
        )
    own_placement = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)
    if accelerator.distributed_type in own_placement:
        raise ValueError(
            f"--shard-target does not work under {accelerator.distributed_type.value}, which places models "
            "its own way; allowed: a DDP launch (multi-GPU / multi-CPU) or an FSDP2 config"
        )


def share_of(accelerator: Accelerator, data: TokenizedData, indices: list[int]) -> Batch:
    """This process's rows of a global batch. A process left without any (a batch with fewer rows
    than processes) takes the batch's first row with no loss and length 0: it teaches and counts
    nothing, yet runs the forwards the others run, which are collectives under DDP and FSDP."""
    mine = indices[accelerator.process_index :: accelerator.num_processes]
    if mine:
        return collate(data, mine)
    filler = collate(data, indices[:1])
    no_loss, no_tokens = torch.zeros_like(filler.loss_mask), torch.zeros_like(filler.lengths)
    return Batch(filler.record_ids, filler.input_ids, no_loss, no_tokens)


def train_step(
    accelerator: Accelerator, objective: nn.Module, optimizer: torch.optim.Optimizer, scheduler, batch: Batch,
    states: TargetBatch, target_lm_head: nn.Module, max_grad_norm: float,
) -> tuple[float, int]:
    """One optimizer step on this process's share of a global batch. Returns the batch's loss per
    label over every process, and its tokens over every process."""
    out = objective(batch.input_ids, batch.loss_mask, states, target_lm_head)
    label_count = reduce_sum(accelerator, out["num_label_positions"]).clamp(min=1)
    # DDP and FSDP average the processes' gradients: times N, the sums over the global label count add up
    loss = out["loss_sum"] * accelerator.num_processes / label_count
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(objective.parameters(), max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    tokens = int(reduce_sum(accelerator, batch.lengths.sum()))
    return float(reduce_sum(accelerator, out["loss_sum"])) / float(label_count), tokens


def gathered_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` on the CPU, FSDP2's shards (DTensors) gathered whole. Gathering is a
    collective: under FSDP every process calls this."""
    return {
        name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu()
        for name, tensor in module.state_dict().items()
    }


def head_from_state(
    head_config: EagleHeadConfig, state: dict[str, torch.Tensor], dtype: torch.dtype
) -> EagleHead:
    """A plain head holding `state` (no FSDP, no borrowed target modules): what the output folder gets."""
    with torch.device("meta"):  # no random initialisation of weights about to be replaced
        head = EagleHead(head_config)
    head.load_state_dict(state, assign=True)
    return head.to(dtype).eval()


def evaluate(
    accelerator: Accelerator, objective: DraftTrainingObjective, target: PreTrainedModel, eval_data: TokenizedData,
    batches: Iterable[Batch], states_for: Callable[[Batch, TokenizedData], TargetBatch],
) -> dict:
    """Held-out loss, per-step draft accuracy and simulated acceptance length (k = the unrolled steps)."""
    objective.eval()
    totals: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for indices in batches:
            batch = share_of(accelerator, eval_data, indices)
            out = objective(batch.input_ids, batch.loss_mask, states_for(batch, eval_data), target.get_output_embeddings())
            for key, value in out.items():
                totals[key] = totals.get(key, 0) + value.detach()
    objective.train()
    totals = {k: reduce_sum(accelerator, v) for k, v in totals.items()}
    count = max(int(totals["num_label_positions"]), 1)
    metrics = {
        "eval/loss": float(totals["loss_sum"]) / count,
        "eval/simulated_tau": 1.0 + float(totals["accepted_len_sum"]) / max(int(totals["accepted_len_count"]), 1),
    }
    for step, (correct, counted) in enumerate(zip(totals["correct"].tolist(), totals["counted"].tolist())):
        metrics[f"eval/accuracy_step_{step}"] = correct / max(counted, 1)
    return metrics


def _warn_if_emulated_bf16(accelerator, args) -> None:
    """bf16 autocast on a CPU without native bf16 (no AVX512-BF16 / AMX) runs emulated kernels: on
    a 2-core AVX2 EPYC the head's backward took 95 s against 1.9 s in fp32. Allowed, but said."""
    asked = [f"--{name} bf16" for name, value in (("mixed-precision", args.mixed_precision),
                                                   ("target-precision", args.target_precision)) if value == "bf16"]
    if asked and accelerator.device.type == "cpu":
        native = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        if native is not None and not native():
            accelerator.print(
                f"warning: {' and '.join(asked)} on a CPU without native bf16 support is far slower than "
                "fp32 here (measured 20x on an AVX2 CPU); fp32 (the default) is the fast choice"
            )


def newest_checkpoint(output: Path) -> Path | None:
    folders = sorted((output / CHECKPOINTS).glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return folders[-1] if folders else None


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    from accelerate import Accelerator
    from accelerate.utils import is_tensorboard_available, set_seed
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    output = Path(args.output)
    log_with = None
    if args.report_to == "tensorboard" or (args.report_to == "auto" and is_tensorboard_available()):
        if not is_tensorboard_available():
            raise ValueError("--report-to tensorboard needs the tensorboard package (pip install tensorboard)")
        log_with = "tensorboard"
    # the loop splits each global batch itself and steps the scheduler once per optimizer step; by
    # default Accelerate would step it once per process, N times too fast under N processes
    accelerator = Accelerator(mixed_precision=args.mixed_precision, log_with=log_with, project_dir=str(output),
                              step_scheduler_with_optimizer=False)
    _warn_if_emulated_bf16(accelerator, args)
    check_distributed_setup(accelerator, args.shard_target)
    set_seed(args.seed)
    if args.batch_size < accelerator.num_processes:
        raise ValueError(
            f"--batch-size={args.batch_size} is smaller than the {accelerator.num_processes} processes; "
            "allowed: at least one conversation per process"
        )

    target, tokenizer = load_target(args.target, args.trust_remote_code,
                                    accelerator.num_processes if args.shard_target else 1)
    if not args.shard_target:  # sharded, each process's part already sits on its device
        target.to(accelerator.device)
    records = load_records(args.data, args.data_split)
    if args.max_records is not None:
        records = records.select(range(min(args.max_records, len(records))))
    data = tokenize_records(records, tokenizer, args.max_length)
    train_ids, eval_ids = split_train_eval(len(data), args.eval_fraction, args.eval_seed)
    train_data, eval_data = data.subset(train_ids), data.subset(eval_ids[: args.max_eval_records])
    head = build_head(args, target, train_data)
    feature_layers = head.feature_layers_for(len(decoder_parts(target)[0]))

    states_for = _target_states(args, accelerator, target, feature_layers, train_data, eval_data, tqdm)
    objective = DraftTrainingObjective(
        head, num_steps=args.ttt_steps, step_weight=args.step_weight,
        target_matmul_dtype=_autocast_dtype(args.target_precision) or target.dtype,
    )
    optimizer = torch.optim.AdamW(
        [p for p in head.parameters() if p.requires_grad], lr=args.lr, weight_decay=args.weight_decay
    )
    train_lengths = [len(ids) for ids in train_data.input_ids]
    batches_per_epoch = len(length_grouped_batches(train_lengths, args.batch_size, args.seed, 0))
    total_steps = args.num_epochs * batches_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    scheduler = get_cosine_schedule_with_warmup(optimizer, min(args.warmup_steps, total_steps), total_steps)
    objective, optimizer, scheduler = accelerator.prepare(objective, optimizer, scheduler)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        checkpoint = newest_checkpoint(output)
        if checkpoint is None:
            raise ValueError(f"--resume: no checkpoint under {str(output / CHECKPOINTS)!r}")
        accelerator.load_state(str(checkpoint))
        if accelerator.is_main_process:
            _drop_log_records_after(output / TRAIN_LOG, progress.step)
        accelerator.print(f"resumed from {checkpoint} at step {progress.step}")
    if log_with:
        accelerator.init_trackers("eagle_head", config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})

    eval_batches = [
        list(range(i, min(i + args.batch_size, len(eval_data)))) for i in range(0, len(eval_data), args.batch_size)
    ]
    bar = tqdm(total=total_steps, initial=progress.step, disable=not accelerator.is_main_process, desc="training")
    eval_metrics: dict = {}
    started = time.perf_counter()
    while progress.step < total_steps and progress.epoch < args.num_epochs:
        batches = length_grouped_batches(train_lengths, args.batch_size, args.seed, progress.epoch)
        for indices in batches[progress.batch_in_epoch :]:
            if progress.step >= total_steps:
                break
            batch = share_of(accelerator, train_data, indices)
            train_loss, tokens = train_step(accelerator, objective, optimizer, scheduler, batch,
                                            states_for(batch, train_data), target.get_output_embeddings(),
                                            args.max_grad_norm)
            progress.step += 1
            progress.batch_in_epoch += 1
            progress.tokens_seen += tokens
            record = {"step": progress.step, "loss": train_loss, "lr": scheduler.get_last_lr()[0],
                      "tokens_seen": progress.tokens_seen, "seconds": time.perf_counter() - started}
            if args.eval_every and progress.step % args.eval_every == 0:
                eval_metrics = evaluate(accelerator, objective, target, eval_data, eval_batches, states_for)
                record.update(eval_metrics)
            _log(accelerator, output, record, log_with)
            bar.update(1)
            bar.set_postfix(loss=f"{train_loss:.3f}")
            if args.save_every and progress.step % args.save_every == 0:
                _save_checkpoint(accelerator, output, progress.step, args.keep_checkpoints)
        else:
            progress.epoch += 1
            progress.batch_in_epoch = 0
    bar.close()
    if eval_data.input_ids and (not eval_metrics or not args.eval_every or progress.step % args.eval_every):
        eval_metrics = evaluate(accelerator, objective, target, eval_data, eval_batches, states_for)
        _log(accelerator, output, {"step": progress.step, **eval_metrics}, log_with)
    if log_with:
        accelerator.end_training()
    trained = accelerator.unwrap_model(objective)
    state = gathered_state_dict(trained)  # every process: a collective under FSDP
    if accelerator.is_main_process:
        held_out = {"seed": args.eval_seed, "records": len(eval_ids), "evaluated": len(eval_data.input_ids),
                    "ids_sha256": hashlib.sha256(",".join(map(str, eval_ids)).encode()).hexdigest()}
        head_state = {name.removeprefix("head."): tensor for name, tensor in state.items()}
        saved = head_from_state(trained.head.head_config, head_state, getattr(torch, args.save_dtype))
        _write_output(args, saved, output, progress, eval_metrics, len(train_data), held_out,
                      accelerator.num_processes)
    accelerator.wait_for_everyone()
    return output


def _autocast_dtype(precision: str) -> torch.dtype | None:
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def _target_states(args, accelerator, target, feature_layers, train_data, eval_data, tqdm):
    """A function (batch, data) -> TargetBatch: online forwards, or the offline cache (built first if needed)."""
    autocast_dtype = _autocast_dtype(args.target_precision)
    if args.hidden_states_cache is None:
        return lambda batch, data: run_target(target, batch.input_ids, feature_layers, autocast_dtype)
    caches = {}
    for name, data in (("train", train_data), ("eval", eval_data)):
        fingerprint = {
            "target": str(args.target), "feature_layers": list(feature_layers), "records": len(data),
            "tokens_hash": _tokens_hash(data),
        }
        if autocast_dtype is not None:  # fp32 caches keep the fingerprint they had before this option
            fingerprint["target_precision"] = args.target_precision
        cache = OfflineTargetStates(Path(args.hidden_states_cache) / name, fingerprint)
        # each process writes its share of the missing records, then everyone reads every shard;
        # the barrier: every process lists what is missing before any writes its shard
        missing = cache.missing(range(len(data)))
        accelerator.wait_for_everyone()
        if missing:
            mine = missing[accelerator.process_index :: accelerator.num_processes]
            bar = tqdm(total=len(mine), desc=f"caching {name} hidden states", disable=not accelerator.is_main_process)
            shard = f"shard_{int(time.time())}_{accelerator.process_index:03d}"
            # sharded, every process runs as many target forwards as the first, which has the most records
            most = math.ceil(math.ceil(len(missing) / accelerator.num_processes) / args.batch_size)
            cache.build(target, data, mine, feature_layers, args.batch_size, shard, bar, autocast_dtype,
                        num_forwards=most if args.shard_target else 0)
            bar.close()
            accelerator.wait_for_everyone()
            cache.reload()
        caches[id(data)] = cache
    dtype = target.dtype
    return lambda batch, data: caches[id(data)].load(batch, dtype)


def _tokens_hash(data: TokenizedData) -> str:
    digest = hashlib.sha256()
    for ids, mask in zip(data.input_ids, data.loss_masks):
        digest.update(json.dumps([ids, mask]).encode())
    return digest.hexdigest()[:16]


def _log(accelerator, output: Path, record: dict, log_with) -> None:
    if log_with:
        accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        with open(output / TRAIN_LOG, "a") as log:
            log.write(json.dumps(record) + "\n")
        if any(key.startswith("eval/") for key in record):
            summary = ", ".join(f"{k[5:]} {v:.4f}" for k, v in record.items() if k.startswith("eval/"))
            accelerator.print(f"step {record['step']}: {summary}")


def _drop_log_records_after(log_path: Path, step: int) -> None:
    """A killed run may have logged steps past its last checkpoint; the resumed run logs them again."""
    if log_path.exists():
        kept = [line for line in log_path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        log_path.write_text("".join(line + "\n" for line in kept))


def _save_checkpoint(accelerator, output: Path, step: int, keep: int) -> None:
    accelerator.save_state(str(output / CHECKPOINTS / f"step_{step}"))
    if accelerator.is_main_process and keep > 0:
        folders = sorted((output / CHECKPOINTS).glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        for old in folders[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def _write_output(args, saved: EagleHead, output: Path, progress: TrainingProgress, eval_metrics: dict,
                  num_train_records: int, held_out: dict, num_processes: int) -> None:
    """The Hub-ready folder: the head (already in --save-dtype), its card, and how it was trained
    (`held_out` names the evaluation records by their split seed, count and a hash of their
    indices, so a run continuing this head can check it holds out the same ones)."""
    saved.save_pretrained(output)
    state = {
        "method": args.method,
        "target": args.target,
        "init_from": args.init_from,
        "data": args.data,
        "num_train_records": num_train_records,
        "held_out": held_out,
        "steps": progress.step,
        "epochs_completed": progress.epoch,
        "tokens_seen": progress.tokens_seen,
        "max_length": args.max_length,
        "ttt_steps": args.ttt_steps,
        "draft_vocab_size": saved.head_config.draft_vocab_size,
        "eval": eval_metrics,
        "num_processes": num_processes,
        "command": args.command,
    }
    (output / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
    fields = card_fields(state, args)
    write_model_card(output, {**head_card_fields(saved.head_config), "repo_id": args.push_to_hub or str(output), **fields})
    if args.push_to_hub:
        push_head_folder(output, args.push_to_hub, card_fields=fields)


def card_fields(state: dict, args: argparse.Namespace) -> dict:
    """The model card's training fields from a finished run (`trainer_state.json`)."""
    tau = state["eval"].get("eval/simulated_tau")
    return {
        "base_model": args.base_model or args.target,
        "training_data": args.data if not args.init_from else f"{args.data} (continuing the head {args.init_from})",
        "num_records": state["num_train_records"],
        "num_steps": state["steps"],
        "tokens_seen": state["tokens_seen"],
        "max_length": state["max_length"],
        "ttt_steps": state["ttt_steps"],
        "training_command": state["command"],
        "tau": "not measured yet (simulated on held-out data during training: "
        + ("n/a" if tau is None or math.isnan(tau) else f"{tau:.2f}") + ")",
    }


if __name__ == "__main__":
    main()
