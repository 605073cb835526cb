"""Targets sharded by transformers' tensor parallelism (`from_pretrained(..., distributed_config=
DistributedConfig(tp_size=N))` under `torchrun`): what speculation needs from us there.

Every rank runs the same loop on the same rows; only the target's weights (and so its KV heads)
are split, and each of its forwards joins the ranks in all-reduces / all-gathers that give every
rank the same logits. That holds only while every rank feeds the same tokens: ranks that fed
different ones would sum partial results of different inputs (garbage on all of them), or,
with different token counts, wait on each other forever. So:

- `check_ranks_agree`: before each forward of a sharded model, the ranks compare a digest of its
  tokens and positions, and all raise the same error when they differ (different prompts,
  generation options or seeds reach the forward after at most one step);
- `agreed_seconds`: choices made from timings (`num_speculative_tokens="auto"`, `tree="auto"`)
  would part the ranks, each timing its own steps. Every other input of those choices (acceptance,
  rows, step counts) is the same on every rank, so the ranks agree on each step's time, the
  slowest rank's, and the controllers choose alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tensor_parallel_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The process group transformers sharded `model`'s weights over (None: not tensor-parallel)."""
    if (getattr(model, "tp_size", None) or 1) <= 1:
        return None
    return model._device_mesh.get_group("tp")


def agreed_seconds(model: torch.nn.Module, seconds: float) -> float:
    """A step's time as every rank of a tensor-parallel `model` takes it: the slowest rank's (see the
    module doc). `seconds` itself for other models. Call it on every rank for the same step."""
    group = tensor_parallel_group(model)
    if group is None:
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=model.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def check_ranks_agree(group: dist.ProcessGroup, input_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
    """RuntimeError on every rank of `group` unless all of them hold these same tokens and positions."""
    digest = torch.stack([
        torch.tensor(input_ids.numel(), device=input_ids.device), _weighted_sum(input_ids), _weighted_sum(position_ids)
    ])  # fmt: skip
    gathered = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, digest, group=group)
    per_rank = [tuple(g.tolist()) for g in gathered]
    if len(set(per_rank)) > 1:
        raise RuntimeError(
            "tensor-parallel ranks disagree on the tokens of this forward (per rank: token count, id digest, position "
            f"digest = {per_rank}): every rank must make the same generate() / engine calls with the same prompts, "
            "generation options and seeds (speculative_config 'seed', or the same torch.manual_seed on every rank)"
        )


def _weighted_sum(values: torch.Tensor) -> torch.Tensor:
    """sum(i * values[i]): equal for equal tensors, and tells apart reorderings a plain sum would not."""
    flat = values.flatten().to(torch.int64)
    return (flat * torch.arange(1, flat.numel() + 1, device=flat.device)).sum()
