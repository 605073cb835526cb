"""The cost of verifying a draft: a target forward over N + 1 tokens per row against a 1-token decode forward.

A step that drafted N tokens (a chain of k = N, or a tree of N nodes) verifies them in one target
forward over N + 1 tokens per row (the pending token, then the drafts). On a CPU, or a GPU at a large
batch, that forward grows with the tokens it carries, which is what decides whether a bigger tree's
extra accepted tokens pay. `measure_verify_costs` times it directly on the run's own model and
prompts, at the run's batch size, through the loop's own path: the paged KV cache and attention, the
fp32 CPU linears the arm runs, every draft's logits kept, a tree's mask among its nodes. The prompts
are prefilled once; then the 1-token forward and every arm's verify forward run in turn (the order
reversed every other repeat), each rolled back after, `repeats` times after one untimed round;
cost (`ratio`) = median verify time / median 1-token time (`ratio_of_minimums`: the fastest of
each, less moved by other processes on a busy machine).

A tree is timed in the largest shape its spec allows (the drafter may keep fewer nodes: the arm's
`mean_tree_size` says how many it did): a static tree as listed; a dynamic one as EAGLE-2 grows it,
the `topk` first nodes of each depth expanded into `topk` children each, up to `num_nodes` and `depth`.
(The shape changes only the mask among the new tokens; the cost is in the tokens.)
"""

from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np
import torch
from transformers import PreTrainedModel

from ..cache.forward import forward_tokens
from ..cache.paged_attention import use_paged_attention
from ..cache.paged_cache import PagedKVCache
from ..config import TreeSpec
from ..loop.tree_verify import tree_layout
from ..models.cpu_linear import fast_cpu_linears, resolve_backend
from ..transfer import to_device
from .arms import Arm

DEFAULT_REPEATS = 5
BLOCK_SIZE = 16


def timing_tree(tree: TreeSpec) -> np.ndarray:
    """The parents array of the tree `tree` is timed as (see the module docstring)."""
    if tree.static_paths is not None:
        index = {path: node for node, path in enumerate(tree.static_paths)}  # parents come first
        return np.array([index.get(path[:-1], -1) for path in tree.static_paths], dtype=np.int64)
    parents: list[int] = []
    frontier = [-1]  # the root
    for _ in range(tree.depth):
        children = []
        for parent in frontier[: tree.topk]:
            for _ in range(tree.topk):
                if len(parents) < tree.num_nodes:
                    children.append(len(parents))
                    parents.append(parent)
        frontier = children
        if not frontier:
            break
    return np.array(parents, dtype=np.int64)


def draft_shape(arm: Arm) -> int | np.ndarray | None:
    """What `arm` verifies each step, its draft's shape: its chain's k (the causal mask among the new
    tokens) or its tree's parents array (`timing_tree`); None: not ours, or "auto" k."""
    config = arm.generate_kwargs.get("speculative_config")
    if config is None or config.auto_k:
        return None
    return config.max_draft_tokens if config.tree is None else timing_tree(config.tree)


def _nodes(shape: int | np.ndarray) -> int:
    return shape if isinstance(shape, int) else len(shape)


def _now(model) -> float:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter()


@torch.no_grad()
def time_verify_forwards(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    shapes: list[int | np.ndarray],
    cpu_linear_backend: str = "auto",
    repeats: int = DEFAULT_REPEATS,
) -> tuple[list[float], list[float]]:
    """(seconds of each 1-token forward, seconds of each verify forward per shape) over the rows of
    `input_ids` (left-padded, as the tokenizer gives them); `model` must have `hf_specdec.enable` applied."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} is invalid; allowed: an integer >= 1")
    prompts = [ids[mask.bool()] for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    rows = list(range(len(prompts)))
    most = 1 + max([0, *(_nodes(s) for s in shapes)])
    cache = PagedKVCache.for_model(
        model,
        num_blocks=sum(-(-(int(n) + most) // BLOCK_SIZE) for n in lengths),
        block_size=BLOCK_SIZE,
        max_rollback=most,
    )
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    backend = resolve_backend(cpu_linear_backend, [model])
    linears = fast_cpu_linears(model, backend=backend) if backend != "torch" else contextlib.nullcontext()

    def forward(shape: int | np.ndarray) -> float:
        count = _nodes(shape) + 1
        if isinstance(shape, int):
            positions, tree_mask = np.concatenate([np.arange(n, n + count) for n in lengths]), None
        else:
            positions, tree_mask = tree_layout(lengths, np.ones(len(rows), dtype=np.int64), [shape] * len(rows))
        tokens = torch.randint(0, vocab, (len(rows) * count,), generator=generator).numpy()
        ids, position_ids = to_device([tokens, positions], model.device)
        keep = np.arange(len(rows) * count)  # the loop keeps the logits of the pending token and of every draft
        started = _now(model)
        forward_tokens(model, cache, rows, [count] * len(rows), ids, position_ids, keep, tree_mask=tree_mask)
        seconds = _now(model) - started
        for row, length in zip(rows, lengths):
            cache.rollback(row, int(length))
        return seconds

    order = [0, *shapes]  # 0: the 1-token decode forward
    times: list[list[float]] = [[] for _ in order]
    with use_paged_attention(model), linears:
        ids, positions = to_device(
            [torch.cat(prompts).numpy(), np.concatenate([np.arange(n) for n in lengths])], model.device
        )
        forward_tokens(model, cache, rows, lengths.tolist(), ids, positions, np.cumsum(lengths) - 1)
        for shape in order:  # untimed: one-time costs (kernel compiles, allocator) out of the way
            forward(shape)
        for repeat in range(repeats):
            indices = range(len(order)) if repeat % 2 == 0 else reversed(range(len(order)))
            for index in indices:
                times[index].append(forward(order[index]))
    return times[0], times[1:]


def measure_verify_costs(
    model: PreTrainedModel, inputs: dict, arms: list[Arm], repeats: int = DEFAULT_REPEATS
) -> dict[str, dict]:
    """Per arm of ours with a fixed k, the cost of its verify forward against a 1-token forward over
    the rows of `inputs` (the tokenizer's output for one batch of the run), on the arm's own CPU
    linear route; arms sharing a route are timed together, each distinct shape once."""
    by_backend: dict[str, list[tuple[str, int | np.ndarray]]] = {}
    for arm in arms:
        shape = draft_shape(arm)
        if shape is not None:
            config = arm.generate_kwargs["speculative_config"]
            by_backend.setdefault(resolve_backend(config.cpu_linear_backend, [model]), []).append((arm.name, shape))
    costs = {}
    batch_size = int(inputs["input_ids"].shape[0])
    for backend, named in by_backend.items():
        shapes: list[int | np.ndarray] = []
        keys: list[object] = []
        for _, shape in named:
            key = shape if isinstance(shape, int) else tuple(shape.tolist())
            if key not in keys:
                keys.append(key)
                shapes.append(shape)
        decode, verify = time_verify_forwards(
            model, inputs["input_ids"], inputs["attention_mask"], shapes, backend, repeats
        )
        decode_s = statistics.median(decode)
        for name, shape in named:
            key = shape if isinstance(shape, int) else tuple(shape.tolist())
            verify_s = statistics.median(verify[keys.index(key)])
            costs[name] = {
                # the fastest of each: on a busy machine the least disturbed (medians are what `ratio` compares)
                "ratio_of_minimums": min(verify[keys.index(key)]) / min(decode),
                "nodes": _nodes(shape),
                "tokens_per_row": _nodes(shape) + 1,
                "batch_size": batch_size,
                "tree": not isinstance(shape, int),
                "decode_forward_s": decode_s,
                "verify_forward_s": verify_s,
                "ratio": verify_s / decode_s,
                "repeats": repeats,
                "cpu_linear_backend": backend,
            }
    return costs
