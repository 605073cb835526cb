"""Speculative vs plain greedy generate() on a Llama-3.1-8B-shaped bf16 target with random weights,
on one CUDA GPU, with an oracle drafter of set acceptance (issue #34). Nothing is downloaded.

    python benchmarks/bench_gpu.py                  # the default grid, stops starting cells after --budget-s
    python benchmarks/bench_gpu.py --attention      # + the paged attention kernel vs gather + SDPA
    python benchmarks/bench_gpu.py --batches 1,32 --ks 4 --alphas 0.8 --contexts 1k   # a grid of your own
    python benchmarks/bench_gpu.py --attention-only
    python benchmarks/bench_gpu.py --tree-widths 4,2,2,1 --tree-cells all   # the tree arm in every cell
    python benchmarks/bench_gpu.py --cpu-smoke      # the same code paths on a tiny fp32 Llama on CPU (< 1 min)

The target: LlamaConfig hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads, vocab
128256, rope_theta 500000, built on the GPU in bf16 (`torch.device("cuda")` + `from_config`),
seeded. `--target-weights decisive` (the default on GPU): the layers keep a small random init
(`--init-std`), the embedding is N(0, 1) and the LM head maps token t's embedding to a random
permutation pi(t), so the greedy continuation is a walk whose top-1 margin is far above bf16
noise. With plain random weights (`random`) a bf16 top-2 gap is often below the rounding
difference between plain generate() and our packed verify forward, the two greedy outputs part
after a few tokens, and the oracle (which proposes plain's continuation) stops being accepted.
The forwards cost the same either way.

The drafter is an oracle (`OracleProposer`): row r, n tokens into its output, proposes plain
generate()'s greedy tokens n..n+k-1, each replaced by a wrong id with probability 1 - alpha
(seeded, the draws keyed by row, position and rank), so the acceptance is set and the output must
stay plain's. It gets into the loop by replacing `hf_specdec.loop.engine.build_proposer` for the
call (there is no public hook for a proposer object); the carrier config is {"method": "ngram",
"num_speculative_tokens": k}.

The tree arm (`ours_tree`, issue #35): the same oracle in tree form. `--tree-widths 4,2,2,1`
(children per node at each depth) gives every row, every step, the full tree of that shape: 4 +
8 + 16 + 16 = 44 nodes, depth 4, compared with the chain of k = 4 at the same alpha. At each depth
the children of the node on the correct path hold the reference token with chance a_d, the other
candidates (and every child of a node off the correct path) distinct wrong tokens. What alpha means
for the tree (`--tree-acceptance`):
  per-candidate (default): alpha per candidate, as the chain's per draft: candidate c (rank order)
    is the reference with chance alpha given candidates 0..c-1 are not, so a_d = 1 - (1 - alpha)^w_d
    (4,2,2,1 at 0.8: 0.998, 0.96, 0.96, 0.8) and the top candidate is the reference exactly when the
    chain's draft at that position is (the same draws): the chain is the tree with widths 1, the
    tree's tau is at least the chain's in every run, and the tree arm against the chain measures
    what the extra candidates gain against what verifying them costs;
  per-depth: alpha per depth: the reference is a child with chance alpha (the chain's draw) at a
    uniform rank: the tree accepts exactly the chain's tokens (same tau) and the arm measures the
    cost of the extra nodes alone.
The carrier config gains {"tree": {"num_nodes": 44, "topk": 4, "depth": 4}} (ngram takes a tree;
the loop sizes its KV pool for num_nodes more slots per row); the oracle builds the trees itself.
Per tree cell, next to ours' fields: tokens/s, x plain, x chain (tokens/s over the chain arm's at the
same batch, context, alpha and k = depth), tau (and the chain's), nodes per step, the verify forward
(decode steps' forward, CUDA events) and its ratio to the chain's, the expected tokens per step
1 + a_1 + a_1 a_2 + ..., the measured a_d. `--tree-cells`: headline (the default: batch 1 and 32,
alpha 0.8, 1k, ~10 s of the budget), all (every (batch, context, alpha) of the grid), none; a
chain cell of k = depth is added where the grid has none.

Arms, per (batch, context): plain generate() (dynamic cache); plain generate() with
`cache_implementation="static"` and `compile_config=CompileConfig(mode="reduce-overhead")`
(transformers compiles the decode step; the headline shapes only by default, `--compile`); ours,
per (alpha, k). Per arm: tokens/s (batch x max_new_tokens / wall seconds, synchronized), TTFT
(plain: a max_new_tokens=1 call; ours: the first step, prefill + its drafts), time per decode step
(after the first). For ours also: tau, the measured alpha (`conditional_acceptance_rate`), the
loop's own time per step outside the model forward (`spec_metrics` total - forward time - draft
time, / steps; forward time from CUDA events around `forward_tokens`, since the loop does not
synchronize after the forward and its `verify_seconds` on CUDA stop when the kernels are
launched), and measured vs closed-form speedup (seed §12.5, as `hf_specdec/loop/auto_k.py` and
`hf-specdec bench` state it):

    speedup = (1 - alpha^(k+1)) / ((1 - alpha) (1 + c k)),
    1 + c k = ours' time per decode step / plain's time per decode step (measured)

next to the measured decode-only speedup (plain's step time / ours' time per token per row, first
steps excluded) and the end-to-end tokens/s ratio. Exactness: ours' tokens against plain's, row by
row (fp32: must match; bf16: divergent rows counted, with their first differing position).

`--attention`: hf_specdec's paged attention kernel (`hf_specdec.kernels.paged_attention`,
imported when used) against gather (`index_select` of each row's blocks, as `gather_rows` in
`hf_specdec/cache/paged_cache.py`) + SDPA with the causal-in-draft mask, at 1k / 8k / 32k
context, batch 1 and 32, 5 query tokens per row, Llama-8B head shapes, bf16, blocks shuffled in the
pool; CUDA events, median of repeats after warm-up; max |kernel - reference|.

Default grid (`default_grid`, in this order, 128 new tokens, 2 timed calls per arm): ours at alpha
0.8, k 4, context 1k, batch 1 then 32 (the headline points, each with plain first, then the tree
arm); the compiled
arm at those two shapes; alpha 0.6 / 0.9 and k 2 / 8 at batch 1 and at batch 32; batch 8 and 64 at
1k; batch 1 and 8 at 8k; the alpha x k corners at batch 1. Estimated (not yet measured) on an H200:
~4.5 min, of which the two compiles are ~2 min; `--budget-s` (default 255 s) drops the tail if
they run longer. Ours runs the paged attention kernel on CUDA (`--ours-attention torch`: the
gather + SDPA path instead).

`--budget-s`: no cell starts when its estimated cost (measured on earlier cells of its kind)
would end past the budget, counted from the start of main(); skipped cells are listed in the JSON.
The JSON (`--out`, default benchmarks/bench_gpu_<gpu-name>.json) holds every number printed.
`--cpu-smoke`: a 2-layer fp32 Llama (hidden 64, vocab 512) on CPU, batch 1 and 2, k 2, context
64, 32 tokens, random weights, the tree arm (widths 2,2) in both cells; the static-cache arm runs
eagerly (compile skipped: recorded in the JSON); the attention section runs the reference only,
and the kernel as well when TRITON_INTERPRET=1 is set (Triton's CPU interpreter). It exits 1 when
ours or the tree arm differs from plain, or a tree check fails (`smoke_tree_checks`: per-candidate
tau at least the chain's per cell and above it pooled over the cells; per-depth: equal).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, CompileConfig, LlamaConfig, PreTrainedModel

import hf_specdec
from hf_specdec.config import SpeculativeConfig
from hf_specdec.drafters import DraftProposal, ProposeRequest
from hf_specdec.loop import engine, step
from hf_specdec.loop.auto_k import expected_tokens

LLAMA_8B_SHAPE = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
}
SMOKE_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "rope_theta": 500000.0,
    "max_position_embeddings": 4096,
}
PAD_TOKEN_ID = 0
COMPILE_CONFIG = CompileConfig(
    mode="reduce-overhead"
)  # one object: generate() recompiles for a different config
FIRST_PROMPT_ID = 3  # prompts draw ids from here on
HEADLINE_SHAPES = ((1, 1024), (32, 1024))  # (batch, context): the compiled arm runs here by default
FULL_BATCHES, FULL_KS, FULL_ALPHAS, FULL_CONTEXTS = (1, 8, 32, 64), (2, 4, 8), (0.6, 0.8, 0.9), (1024, 8192)
# a cell's cost before one of its kind was measured (seconds; on an H200, guessed)
PRIOR_COST_S = {"plain": 15.0, "compiled": 100.0, "ours": 8.0, "ours_tree": 10.0}
SMOKE_PRIOR_COST_S = {"plain": 2.0, "compiled": 2.0, "ours": 2.0, "ours_tree": 2.0}
HEADLINE_ALPHA = 0.8
TREE_WIDTHS, SMOKE_TREE_WIDTHS = "4,2,2,1", "2,2"  # children per node at each depth (--tree-widths)
FORMULA = (
    "predicted speedup = (1 - alpha^(k+1)) / ((1 - alpha) (1 + c k)) (seed §12.5, hf_specdec/loop/auto_k.py), "
    "1 + c k = step_cost_ratio = ours' time per decode step / plain's time per decode step (first steps excluded), "
    "c = (step_cost_ratio - 1) / drafts per row-step (as hf_specdec/bench/runner.py); measured_decode_speedup = "
    "plain's step time / ours' decode time per token per row (at batch > 1 the batch runs until its last row ends); "
    "predicted_speedup_forward_only uses verify_cost_ratio = ours' decode forward / plain's step instead"
)
NOTES = {
    "tokens_per_s": "batch x max_new_tokens / median wall seconds of the call (synchronized); no EOS, every row "
    "generates max_new_tokens",
    "per_step_ms": "averages over every step of the median call, the first (prompt) step included, except decode_*: "
    "total/draft/verify/sampler from spec_metrics; forward: CUDA events around the loop's forward_tokens (the loop "
    "does not synchronize after its forward, so spec_metrics' verify stops when the kernels are launched on CUDA); "
    "loop_overhead = (total - forward - draft) / steps: the loop's own time outside the model forward",
    "ttft_s": "plain / compiled: a max_new_tokens=1 call; ours: the call's start to its second step",
    "exactness_vs_plain": "each row's new tokens against plain generate()'s; divergences give the first differing "
    "position",
}


@dataclass(frozen=True)
class Cell:
    """One unit of the grid: the compiled arm of a shape, or ours at one (alpha, k)."""

    # "compiled", "ours" (the chain oracle) or "ours_tree" (the tree oracle, k = its depth); plain runs once
    # per shape, when a cell of the shape first needs it
    kind: str
    batch: int
    context: int
    alpha: float | None = None
    k: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.batch, self.context

    def label(self) -> str:
        if self.kind == "ours":
            return f"ours b={self.batch} ctx={self.context} alpha={self.alpha} k={self.k}"
        if self.kind == "ours_tree":
            return f"ours_tree b={self.batch} ctx={self.context} alpha={self.alpha} depth={self.k}"
        return f"{self.kind} b={self.batch} ctx={self.context}"


# --- the oracle drafter ----------------------------------------------------------------------------


def tree_topology(widths: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The full tree of `widths` (every node at depth d has widths[d] children), in level order (a
    depth's nodes after the shallower ones, siblings together, in rank order): each node's parent
    (-1: a child of the root), depth (1-based), rank among its siblings; each depth's first node and
    the node count of the depths up to L (`upto[L]`, L = 0..len(widths))."""
    sizes = np.cumprod(widths).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    parents, depths, ranks = [], [], []
    for d, (width, size) in enumerate(zip(widths, sizes)):
        local = np.arange(size)
        parents.append(np.full(size, -1) if d == 0 else starts[d - 1] + local // width)
        depths.append(np.full(size, d + 1))
        ranks.append(local % width)
    return {
        "parents": np.concatenate(parents).astype(np.int64),
        "depths": np.concatenate(depths).astype(np.int64),
        "ranks": np.concatenate(ranks).astype(np.int64),
        "starts": starts[:-1],
        "upto": starts,
    }


def tree_alpha_per_depth(alpha: float, widths: tuple[int, ...], acceptance: str) -> list[float]:
    """The chance the tree's correct path goes one depth deeper, given it reached the depth above:
    per-candidate: 1 - (1 - alpha)^w_d (each candidate a try that hits with probability alpha);
    per-depth: alpha at every depth (see OracleProposer)."""
    if acceptance == "per-depth":
        return [alpha] * len(widths)
    return [1 - (1 - alpha) ** width for width in widths]


def expected_tree_tokens(alpha_per_depth: list[float]) -> float:
    """Tokens a step yields on average, 1 + sum over d of the chance its path is d deep:
    1 + a_1 + a_1 a_2 + ... (the chain's 1 + alpha + ... + alpha^k when every a_d is alpha)."""
    return 1.0 + float(np.sum(np.cumprod(alpha_per_depth)))


def distinct_offsets(seed: int, shape: tuple[int, int], columns: int, vocab_size: int) -> np.ndarray:
    """`[*shape, columns]` ints in 1..vocab_size-1, distinct along the last axis: the shifts that turn
    a reference token into wrong candidates. Column c comes from its own stream (seeded by (seed, c))
    and is redrawn where it repeats an earlier column: column 0 does not depend on `columns`."""
    if columns > vocab_size - 1:
        raise ValueError(
            f"{columns} distinct wrong tokens need a vocabulary over {columns}, not {vocab_size}"
        )
    out = np.empty((*shape, columns), dtype=np.int64)
    for column in range(columns):
        rng = np.random.default_rng([seed, 1, column])
        values = rng.integers(1, vocab_size, shape)
        while True:
            clash = (values[..., None] == out[..., :column]).any(-1)
            if not clash.any():
                break
            values[clash] = rng.integers(1, vocab_size, int(clash.sum()))
        out[..., column] = values
    return out


class OracleProposer:
    """Proposes each row's reference greedy continuation, a chain (`widths` None) or a tree, with
    wrong tokens at a set rate (a `Proposer`: `propose`, `release`).

    `reference` `[rows, new tokens]`: plain generate()'s new tokens; every row's prompt is
    `prompt_len` tokens (no padding). The random draws are keyed by (row, new-token position,
    candidate rank), not drawn step by step, and the chain and the tree read the same ones: try
    t(r, p, c) uniform, wrong token (reference[r, p] + offset(r, p, c)) mod vocab, offsets distinct
    over c. Each position is tested at most once in a run, so keyed draws are as good as fresh ones.

    Chain: the draft at position p is the reference iff t(r, p, 0) < alpha, else its wrong token 0.

    Tree (`widths` (w_1, ..., w_D)): every node at depth d has w_d children, sum over d of
    w_1 ... w_d nodes per row and step (shallower when the row has fewer tokens left: depth <=
    max_draft_tokens). The children of a node on the correct path (the root, then each node that
    holds the reference token of its depth) hold the reference token of their depth with chance
    a_d, at rank h; the other children are wrong tokens 0, 1, ... of the position (rank c: wrong
    token c); a node off the correct path gets wrong children only. `acceptance`:
    - "per-candidate" (alpha as the chain's, per candidate): h = the first rank c < w_d with
      t(r, p, c) < alpha; so a_d = 1 - (1 - alpha)^w_d, the top-ranked candidate is the reference
      exactly when the chain's draft at that position is, and widths of 1 are the chain. Per
      position, the tree accepts whatever the chain accepts and more: its tau is at least the
      chain's at the same alpha (strictly above, in expectation, when some w_d > 1 and alpha < 1).
    - "per-depth" (alpha per depth): the reference is a child iff t(r, p, 0) < alpha (the chain's
      draw), at a uniform random rank; a_d = alpha, the tree accepts exactly the chain's tokens
      (same tau), and the tree arm against the chain measures what verifying the extra nodes costs.

    Also records when each step began (its `propose` call) and the tokens every row had generated by then.
    """

    def __init__(
        self,
        reference: np.ndarray,
        prompt_len: int,
        alpha: float,
        vocab_size: int,
        seed: int,
        widths: tuple[int, ...] | None = None,
        acceptance: str = "per-candidate",
    ):
        if acceptance not in ("per-candidate", "per-depth"):
            raise ValueError(f"acceptance={acceptance!r}; allowed: per-candidate, per-depth")
        self.reference = np.asarray(reference, dtype=np.int64)
        self.prompt_len = prompt_len
        self.alpha = alpha
        self.vocab_size = vocab_size
        self.widths = None if widths is None else tuple(int(w) for w in widths)
        self.acceptance = acceptance
        shape = self.reference.shape
        columns = 1 if self.widths is None else max(self.widths)
        self.tries = np.stack(
            [np.random.default_rng([seed, 0, c]).random(shape) for c in range(columns)], axis=-1
        )
        self.offsets = distinct_offsets(seed, shape, columns, vocab_size)
        self.rank_draws = np.random.default_rng([seed, 2]).random(shape)  # per-depth: the reference's rank
        self.topology = None if self.widths is None else tree_topology(self.widths)
        self.step_started: list[float] = []
        self.generated_at_step: list[int] = []  # tokens generated so far, summed over the step's rows
        self.propose_seconds = (
            0.0  # the oracle's own time (the loop's draft_seconds add its draft bookkeeping)
        )

    def propose(self, request: ProposeRequest) -> DraftProposal:
        self.step_started.append(time.perf_counter())
        generated = np.array([len(tokens) for tokens in request.token_ids], dtype=np.int64) - self.prompt_len
        self.generated_at_step.append(int(generated.sum()))
        if self.widths is None:
            proposal = self._chain(request, generated)
        else:
            proposal = self._tree(request, generated)
        self.propose_seconds += time.perf_counter() - self.step_started[-1]
        return proposal

    def _chain(self, request: ProposeRequest, generated: np.ndarray) -> DraftProposal:
        drafts = []
        for i, (row, limit) in enumerate(zip(request.rows, request.max_draft_tokens)):
            span = slice(generated[i], generated[i] + limit)
            right = self.reference[row, span]
            wrong = self.tries[row, span, 0] >= self.alpha
            drafts.append(np.where(wrong, (right + self.offsets[row, span, 0]) % self.vocab_size, right))
        return DraftProposal(draft_token_ids=drafts)

    def _tree(self, request: ProposeRequest, generated: np.ndarray) -> DraftProposal:
        topology, widths = self.topology, np.array(self.widths, dtype=np.int64)
        depth, last = len(widths), self.reference.shape[1] - 1
        rows = np.asarray(request.rows, dtype=np.int64)[:, None]
        # every node's wrong token (rank c: the position's wrong token c); nodes past the end are cut below
        node_positions = np.minimum(generated[:, None] + topology["depths"][None] - 1, last)
        tokens = (
            self.reference[rows, node_positions] + self.offsets[rows, node_positions, topology["ranks"][None]]
        ) % self.vocab_size
        # the correct path: at each depth, does the reference sit among the on-path node's children, at which rank
        positions = np.minimum(generated[:, None] + np.arange(depth)[None], last)  # [rows, depth]
        if self.acceptance == "per-candidate":
            tries = self.tries[rows, positions] < self.alpha  # [rows, depth, max width]
            tries &= np.arange(tries.shape[-1])[None, None] < widths[None, :, None]
            hit, rank = tries.any(-1), tries.argmax(-1)
        else:
            hit = self.tries[rows, positions, 0] < self.alpha
            rank = np.minimum((self.rank_draws[rows, positions] * widths[None]).astype(np.int64), widths - 1)
        on_path = np.cumprod(hit, axis=1).astype(bool)
        right = self.reference[rows, positions]
        local = np.zeros(len(generated), dtype=np.int64)  # the on-path node's index within its depth
        for d in range(depth):
            local = local * widths[d] + rank[:, d]
            alive = np.flatnonzero(on_path[:, d])
            tokens[alive, topology["starts"][d] + local[alive]] = right[alive, d]
        sizes = topology["upto"][np.minimum(np.asarray(request.max_draft_tokens, dtype=np.int64), depth)]
        return DraftProposal(
            draft_token_ids=[tokens[i, :n].copy() for i, n in enumerate(sizes)],
            draft_parents=[topology["parents"][:n].copy() for n in sizes],
        )

    def release(self, rows: list[int], token_ids: list[np.ndarray] | None = None) -> None:
        pass


@contextlib.contextmanager
def oracle_in_loop(oracle: OracleProposer) -> Iterator[OracleProposer]:
    """generate() builds `oracle` as its drafter while this is open (the loop's `build_proposer`
    replaced, as tests/test_auto_k.py does)."""
    original = engine.build_proposer
    engine.build_proposer = lambda *args, **kwargs: oracle
    try:
        yield oracle
    finally:
        engine.build_proposer = original


@contextlib.contextmanager
def timed_forwards(device: torch.device) -> Iterator[list]:
    """Times every target forward of the loop (`step.forward_tokens`): CUDA events on CUDA (no
    synchronization added), wall seconds on CPU. Yields the records; `forward_seconds` reads them."""
    original = step.forward_tokens
    records: list = []

    def timed(*args, **kwargs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = original(*args, **kwargs)
            end.record()
            records.append((start, end))
        else:
            started = time.perf_counter()
            logits = original(*args, **kwargs)
            records.append(time.perf_counter() - started)
        return logits

    step.forward_tokens = timed
    try:
        yield records
    finally:
        step.forward_tokens = original


def forward_seconds(records: list) -> list[float]:
    """Seconds of each forward `timed_forwards` recorded (after a synchronization, on CUDA)."""
    return [
        record[0].elapsed_time(record[1]) / 1000 if isinstance(record, tuple) else record
        for record in records
    ]


# --- the target -------------------------------------------------------------------------------------


def build_target(
    shape: dict, dtype: torch.dtype, device: torch.device, init_std: float, weights: str, seed: int
) -> PreTrainedModel:
    """A random Llama of `shape` built on `device` in `dtype` (no CPU copy); `weights`: "random"
    (every weight N(0, init_std)) or "decisive" (see the module docstring)."""
    config = LlamaConfig(
        **shape,
        initializer_range=init_std,
        tie_word_embeddings=False,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    if weights == "decisive":
        make_greedy_walk_decisive(model, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


@torch.no_grad()
def make_greedy_walk_decisive(model: PreTrainedModel, seed: int) -> None:
    """Embedding rows N(0, 1); LM head row pi(t) = embedding row t / sqrt(hidden) for a random
    permutation pi. With small layer weights the final hidden state stays close to the last
    token's embedding, so its logit of pi(t) is about sqrt(hidden) (64 at 4096) against others of
    standard deviation 1: the greedy next token is pi(t) with a margin far above bf16 noise."""
    embedding = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    generator = torch.Generator(device=embedding.device).manual_seed(seed + 1)
    rows = torch.randn(embedding.shape, generator=generator, device=embedding.device, dtype=torch.float32)
    embedding.copy_(rows)
    permutation = torch.randperm(embedding.shape[0], generator=generator, device=embedding.device)
    lm_head.index_copy_(0, permutation, (rows / math.sqrt(embedding.shape[1])).to(lm_head.dtype))


def random_prompts(
    batch: int, context: int, vocab_size: int, seed: int, device: torch.device
) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + batch * 1009 + context)
    return torch.randint(FIRST_PROMPT_ID, vocab_size, (batch, context), generator=generator, device=device)


def synchronized_now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def first_differences(reference: np.ndarray, other: np.ndarray) -> list[int | None]:
    """Per row, the first new-token position where `other` differs from `reference` (None: identical)."""
    result = []
    for expected, got in zip(reference, other):
        differing = np.flatnonzero(expected != got)
        result.append(int(differing[0]) if len(differing) else None)
    return result


def exactness(reference: np.ndarray, other: np.ndarray) -> dict:
    positions = first_differences(reference, other)
    divergent = [{"row": row, "first_new_token": p} for row, p in enumerate(positions) if p is not None]
    return {"rows": len(positions), "divergent_rows": len(divergent), "divergences": divergent}


# --- the arms ---------------------------------------------------------------------------------------


@dataclass
class ShapeRun:
    """The plain arm of one (batch, context) and what the other arms of the shape compare with."""

    batch: int
    context: int
    prompts: torch.Tensor
    reference: np.ndarray  # [batch, max_new_tokens] plain's greedy tokens
    plain: dict
    compiled: dict | None = None
    ours_warmed_up: bool = False
    tree_warmed_up: bool = False  # the tree arm's verify forwards are another shape (and mask): own warm-up


def timed_generate(
    model: PreTrainedModel, prompts: torch.Tensor, max_new_tokens: int, **kwargs
) -> tuple[float, object]:
    device = prompts.device
    started = synchronized_now(device)
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=max_new_tokens, do_sample=False,
            **kwargs,
        )  # fmt: skip
    return synchronized_now(device) - started, out


def new_tokens(out, context: int) -> np.ndarray:
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    return sequences[:, context:].cpu().numpy()


def arm_summary(
    seconds: list[float], ttft: list[float], batch: int, max_new_tokens: int, weight_bytes: int
) -> dict:
    wall = statistics.median(seconds)
    first = statistics.median(ttft)
    decode_step = (wall - first) / (max_new_tokens - 1) if max_new_tokens > 1 else None
    return {
        "seconds": seconds,
        "wall_s": wall,
        "ttft_s": first,
        "tokens_per_s": batch * max_new_tokens / wall,
        "decode_step_ms": decode_step * 1000 if decode_step is not None else None,
        "forwards": max_new_tokens,
        "weights_gb_per_s": weight_bytes * max_new_tokens / wall / 1e9,
    }


def run_plain(model, batch: int, context: int, args, weight_bytes: int) -> ShapeRun:
    """Plain generate() with the dynamic cache: warm-up, TTFT calls, then the timed full calls."""
    device = model.device
    prompts = random_prompts(batch, context, model.config.vocab_size, args.seed, device)
    timed_generate(model, prompts, min(8, args.max_new_tokens))
    ttft = [timed_generate(model, prompts, 1)[0] for _ in range(args.repeats)]
    seconds, outputs = [], []
    for _ in range(args.repeats):
        elapsed, out = timed_generate(model, prompts, args.max_new_tokens)
        seconds.append(elapsed)
        outputs.append(new_tokens(out, context))
    reference = outputs[0]
    summary = arm_summary(seconds, ttft, batch, args.max_new_tokens, weight_bytes)
    summary["repeats_identical"] = all(np.array_equal(reference, other) for other in outputs[1:])
    return ShapeRun(batch, context, prompts, reference, summary)


def run_compiled(model, shape: ShapeRun, args, weight_bytes: int) -> dict:
    """Plain generate() with the static cache, its decode step compiled by transformers
    (`compile_config`, mode reduce-overhead); in --cpu-smoke the static cache runs eagerly."""
    if args.cpu_smoke:
        kwargs = {"cache_implementation": "static", "disable_compile": True}
        how = "static cache, eager: torch.compile skipped in --cpu-smoke"
    else:
        kwargs = {"cache_implementation": "static", "compile_config": COMPILE_CONFIG}
        how = "static cache + compile_config=CompileConfig(mode='reduce-overhead') (transformers compiles the decode step)"
    raise_recompile_limit()
    first_call_s, _ = timed_generate(
        model, shape.prompts, args.max_new_tokens, **kwargs
    )  # compiles, records graphs
    ttft = [timed_generate(model, shape.prompts, 1, **kwargs)[0] for _ in range(args.repeats)]
    seconds, outputs = [], []
    for _ in range(args.repeats):
        elapsed, out = timed_generate(model, shape.prompts, args.max_new_tokens, **kwargs)
        seconds.append(elapsed)
        outputs.append(new_tokens(out, shape.context))
    # generate() keeps the compiled forward on the model when it compiled (it may decline, with a warning)
    compiled = not args.cpu_smoke and hasattr(model, "_compiled_call")
    summary = {"how": how, "compiled": compiled, "first_call_s": first_call_s}
    summary.update(arm_summary(seconds, ttft, shape.batch, args.max_new_tokens, weight_bytes))
    summary["ratio_vs_plain"] = summary["tokens_per_s"] / shape.plain["tokens_per_s"]
    summary["exactness_vs_plain"] = exactness(shape.reference, outputs[0])
    return summary


def raise_recompile_limit(limit: int = 64) -> None:
    """Each (batch, cache length) recompiles the decode step; past dynamo's limit (8) it would fall
    back to eager without a word, and the arm would time eager code."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
            return


def tree_spec(widths: tuple[int, ...]) -> dict:
    """The `tree` entry for the oracle's tree of `widths`: its node count, its widest node's
    children (topk) and its depth. The loop reads it to size the KV pool (num_nodes slots per row
    past the kept tokens); the oracle builds the trees itself."""
    return {"num_nodes": int(tree_topology(widths)["upto"][-1]), "topk": max(widths), "depth": len(widths)}


def carrier_config(k: int, widths: tuple[int, ...] | None = None) -> dict:
    """The speculative_config generate() receives; the oracle replaces the drafter it names (ngram:
    a tree method, so it takes the `tree` key of the tree arm, with k = the tree's depth)."""
    config = {"method": "ngram", "num_speculative_tokens": k, "cpu_linear_backend": "torch"}
    if widths is not None:
        config["tree"] = tree_spec(widths)
    return config


def ours_once(
    model, shape: ShapeRun, alpha: float, k: int, max_new_tokens: int, seed: int,
    widths: tuple[int, ...] | None = None, acceptance: str = "per-candidate",
) -> dict:  # fmt: skip
    """One speculative generate() with the oracle (a tree of `widths`, else a chain of k); wall
    time and the loop's own measurements."""
    oracle = OracleProposer(
        shape.reference,
        shape.context,
        alpha,
        model.config.vocab_size,
        seed,
        widths=widths,
        acceptance=acceptance,
    )
    with oracle_in_loop(oracle), timed_forwards(model.device) as forwards:
        wall_s, out = timed_generate(
            model, shape.prompts, max_new_tokens, custom_generate=hf_specdec.generate,
            speculative_config=carrier_config(k, widths), return_dict_in_generate=True,
        )  # fmt: skip
        ended = time.perf_counter()
    return {
        "wall_s": wall_s,
        "started": ended - wall_s,  # perf_counter at the call (after a synchronization)
        "ended": ended,
        "tokens": new_tokens(out, shape.context),
        "metrics": out.spec_metrics,
        "forward_s": forward_seconds(forwards),
        "step_started": oracle.step_started,
        "generated_at_step": oracle.generated_at_step,
        "propose_s": oracle.propose_seconds,
    }


def run_ours(
    model,
    shape: ShapeRun,
    alpha: float,
    k: int,
    args,
    weight_bytes: int,
    widths: tuple[int, ...] | None = None,
) -> dict:
    """Ours at (alpha, k) on a shape, `args.repeats` timed calls (the same drafts each time);
    one short warm-up call per shape first (per shape and arm: chain, tree). With `widths` the
    oracle drafts trees of those widths (k must be their depth), with `args.tree_acceptance`; the
    seed is the chain's at the same (alpha, k), so the two arms read the same draws."""
    seed = args.seed * 7919 + int(alpha * 1000) * 31 + k
    acceptance = getattr(args, "tree_acceptance", "per-candidate")

    def once(tokens: int) -> dict:
        return ours_once(model, shape, alpha, k, tokens, seed, widths, acceptance)

    warmed = "ours_warmed_up" if widths is None else "tree_warmed_up"
    if not getattr(shape, warmed):
        once(min(8, args.max_new_tokens))
        setattr(shape, warmed, True)
    runs = [once(args.max_new_tokens) for _ in range(args.repeats)]
    run = sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]  # the median call: its breakdown
    metrics = run["metrics"]
    steps = metrics["num_target_forwards"]
    batch, max_new_tokens = shape.batch, args.max_new_tokens
    wall = statistics.median(r["wall_s"] for r in runs)
    forward_s = sum(run["forward_s"])
    # decode: from the second step's start to the end (the first step carries the prompt)
    decode_s = run["ended"] - run["step_started"][1] if steps > 1 else None
    decode_forward_s = statistics.mean(run["forward_s"][1:]) if steps > 1 else None
    decode_tokens_per_row = (
        (batch * max_new_tokens - run["generated_at_step"][1]) / batch if steps > 1 else None
    )
    plain_step_s = shape.plain["decode_step_ms"] / 1000 if shape.plain["decode_step_ms"] else None
    ours_step_s = decode_s / (steps - 1) if decode_s is not None else None
    drafts_per_row_step = (
        metrics["num_draft_tokens"] / metrics["num_row_steps"] if metrics["num_row_steps"] else 0.0
    )
    cost_ratio = ours_step_s / plain_step_s if ours_step_s and plain_step_s else None
    measured_alpha = metrics["conditional_acceptance_rate"]
    expected = expected_tokens(alpha, k)
    if widths is not None:
        expected = expected_tree_tokens(tree_alpha_per_depth(alpha, widths, acceptance))
    summary = {
        "arm": "ours" if widths is None else "ours_tree",
        "batch": batch,
        "context": shape.context,
        "alpha": alpha,
        "k": k,
        "seconds": [r["wall_s"] for r in runs],
        "wall_s": wall,
        "tokens_per_s": batch * max_new_tokens / wall,
        "ratio_vs_plain": (batch * max_new_tokens / wall) / shape.plain["tokens_per_s"],
        "ratio_vs_compiled": (batch * max_new_tokens / wall) / shape.compiled["tokens_per_s"]
        if shape.compiled and "tokens_per_s" in shape.compiled
        else None,
        "ttft_s": run["step_started"][1] - run["started"] if steps > 1 else wall,
        "target_forwards": steps,
        "forwards_timed": len(run["forward_s"]),  # == target_forwards, else the forward times miss some
        "weights_gb_per_s": weight_bytes * steps / wall / 1e9,
        "tau": metrics["mean_acceptance_length"],
        "num_drafts": metrics[
            "num_drafts"
        ],  # row-steps that drafted: tau = 1 + num_accepted_tokens / num_drafts
        "num_accepted_tokens": metrics["num_accepted_tokens"],
        "measured_alpha": measured_alpha,
        "draft_acceptance_rate": metrics["draft_acceptance_rate"],
        "acceptance_per_position": [n / metrics["num_drafts"] for n in metrics["num_accepted_tokens_per_pos"]]
        if metrics["num_drafts"]
        else [],
        "tokens_per_target_forward": metrics["num_emitted_tokens"] / max(steps, 1),
        "per_step_ms": {
            "total": metrics["total_seconds"] / steps * 1000,
            "forward": forward_s / steps * 1000,
            "draft": metrics["draft_seconds"] / steps * 1000,
            "verify": metrics["verify_seconds"] / steps * 1000,
            "sampler": metrics["sampler_seconds"] / steps * 1000,
            "oracle": run["propose_s"]
            / steps
            * 1000,  # the drafter itself (draft = it + the loop's draft metadata)
            # the loop's own time outside the model forward and the draft phase
            "loop_overhead": (metrics["total_seconds"] - forward_s - metrics["draft_seconds"]) / steps * 1000,
            # the same, the loop's draft bookkeeping (metadata of the drafts, on the device) counted in
            "loop_overhead_with_draft_bookkeeping": (metrics["total_seconds"] - forward_s - run["propose_s"])
            / steps
            * 1000,
            # decode steps only (the first, which carries the prompt, left out): wall time per step, its
            # forward, and the rest (drafting, sampling, bookkeeping, generate()'s return)
            "decode_step": ours_step_s * 1000 if ours_step_s is not None else None,
            "decode_forward": decode_forward_s * 1000 if decode_forward_s is not None else None,
            "decode_outside_forward": (ours_step_s - decode_forward_s) * 1000
            if ours_step_s is not None
            else None,
        },
        "prefill_forward_ms": run["forward_s"][0] * 1000,
        "outside_loop_ms": (wall - metrics["total_seconds"]) * 1000,
        "expected_tokens_per_step": expected,
        "drafts_per_row_step": drafts_per_row_step,
        # draft tokens (a tree's nodes) per row-step that drafted (rows with 1 token left draft none)
        "drafts_per_drafting_row_step": metrics["num_draft_tokens"] / metrics["num_drafts"]
        if metrics["num_drafts"]
        else 0.0,
        "step_cost_ratio": cost_ratio,
        "c": (cost_ratio - 1) / drafts_per_row_step if cost_ratio and drafts_per_row_step else None,
        "predicted_speedup": expected / cost_ratio if cost_ratio else None,
        "predicted_speedup_measured_alpha": expected_tokens(measured_alpha, k) / cost_ratio
        if cost_ratio
        else None,
        # the same with the step's forward alone against plain's step: what a free loop and drafter would give
        "verify_cost_ratio": decode_forward_s / plain_step_s if decode_forward_s and plain_step_s else None,
        "predicted_speedup_forward_only": expected * plain_step_s / decode_forward_s
        if decode_forward_s and plain_step_s
        else None,
        "measured_decode_speedup": plain_step_s / (decode_s / decode_tokens_per_row)
        if decode_s and decode_tokens_per_row and plain_step_s
        else None,
        "exactness_vs_plain": exactness(shape.reference, run["tokens"]),
        "repeats_identical": all(np.array_equal(runs[0]["tokens"], r["tokens"]) for r in runs[1:]),
    }
    return summary


def add_tree_fields(summary: dict, chain: dict | None, widths: tuple[int, ...], acceptance: str) -> dict:
    """The tree arm's own fields on its `run_ours` summary, and its comparison with `chain` (the
    chain arm's summary at the same batch, context, alpha and k = the tree's depth; None when that
    did not run)."""
    per_depth = summary[
        "acceptance_per_position"
    ]  # the share of drafting row-steps whose path reached depth d
    reached = [1.0, *per_depth[:-1]]
    forward = summary["per_step_ms"]["decode_forward"]
    summary["tree"] = {
        "widths": list(widths), **tree_spec(widths), "acceptance": acceptance,
        "alpha_per_depth": tree_alpha_per_depth(summary["alpha"], widths, acceptance),
        "speculative_config": carrier_config(len(widths), widths),
    }  # fmt: skip
    summary["nodes_per_step"] = summary["drafts_per_drafting_row_step"]
    # P(path reaches depth d | it reached d - 1), measured (the last steps' shallower trees pull the deepest down)
    summary["measured_alpha_per_depth"] = [n / r if r else None for n, r in zip(per_depth, reached)]
    summary["verify_forward_ms"] = forward
    summary["chain"] = chain and {
        "k": chain["k"], "tokens_per_s": chain["tokens_per_s"], "tau": chain["tau"], "num_drafts": chain["num_drafts"],
        "num_accepted_tokens": chain["num_accepted_tokens"],
        "measured_alpha": chain["measured_alpha"], "verify_forward_ms": chain["per_step_ms"]["decode_forward"],
        "decode_step_ms": chain["per_step_ms"]["decode_step"],
    }  # fmt: skip
    chain_forward = chain and chain["per_step_ms"]["decode_forward"]
    summary["ratio_vs_chain"] = summary["tokens_per_s"] / chain["tokens_per_s"] if chain else None
    summary["tau_ratio_vs_chain"] = summary["tau"] / chain["tau"] if chain else None
    summary["verify_forward_ratio_vs_chain"] = forward / chain_forward if forward and chain_forward else None
    return summary


# --- the grid and the budget ------------------------------------------------------------------------


def parse_sizes(text: str) -> list[int]:
    """Sizes with an optional k suffix: "1k,8k,512" -> [1024, 8192, 512]."""
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        sizes.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return sizes


def default_grid() -> list[Cell]:
    """The headline points first (batch 1 and 32, alpha 0.8, k 4, context 1k) and the compiled arm
    of their shapes, then sweeps in the order they are worth having: alpha and k at batch 1 and 32,
    the other batch sizes, 8k context, the corners of the batch-1 grid."""
    cells = [Cell("ours", 1, 1024, 0.8, 4), Cell("ours", 32, 1024, 0.8, 4)]
    cells += [Cell("compiled", batch, context) for batch, context in HEADLINE_SHAPES]
    cells += [Cell("ours", 1, 1024, alpha, 4) for alpha in (0.6, 0.9)]
    cells += [Cell("ours", 1, 1024, 0.8, k) for k in (2, 8)]
    cells += [Cell("ours", 32, 1024, 0.8, k) for k in (2, 8)]
    cells += [Cell("ours", 32, 1024, alpha, 4) for alpha in (0.6, 0.9)]
    cells += [Cell("ours", batch, 1024, 0.8, 4) for batch in (8, 64)]
    cells += [Cell("ours", batch, 8192, 0.8, 4) for batch in (1, 8)]
    cells += [Cell("ours", 1, 1024, alpha, k) for alpha in (0.6, 0.9) for k in (2, 8)]
    return cells


def explicit_grid(batches, ks, alphas, contexts, compile_shapes: str) -> list[Cell]:
    """Every (batch, context, alpha, k); per shape its ours cells, then its compiled arm."""
    cells = []
    for context in contexts:
        for batch in batches:
            cells += [Cell("ours", batch, context, alpha, k) for alpha in alphas for k in ks]
            if compile_shapes == "all" or (
                compile_shapes == "headline" and (batch, context) in HEADLINE_SHAPES
            ):
                cells.append(Cell("compiled", batch, context))
    return cells


def with_compile_choice(cells: list[Cell], choice: str) -> list[Cell]:
    """The default grid with its compiled cells as `--compile` says: none, the headline shapes' (as
    it is), or every shape's (the others' last)."""
    if choice == "none":
        return [cell for cell in cells if cell.kind != "compiled"]
    if choice == "all":
        shapes = dict.fromkeys(cell.shape for cell in cells if cell.kind == "ours")
        cells = cells + [
            Cell("compiled", *shape) for shape in shapes if Cell("compiled", *shape) not in cells
        ]
    return cells


def with_tree_cells(cells: list[Cell], depth: int, which: str) -> list[Cell]:
    """`cells` with the tree arm added: after the chain cell of the same (batch, context, alpha) and
    k = `depth` (inserted after the first chain cell of that (batch, context, alpha) when the grid
    has none), for "headline": the headline shapes at alpha 0.8; "all": every (batch, context,
    alpha) of the grid; "none": no tree cells."""
    if which == "none":
        return list(cells)

    def wanted(cell: Cell) -> bool:
        headline = cell.shape in HEADLINE_SHAPES and cell.alpha == HEADLINE_ALPHA
        return cell.kind == "ours" and (which == "all" or headline)

    keys = {(cell.batch, cell.context, cell.alpha) for cell in cells if wanted(cell)}
    has_chain = {key for key in keys if Cell("ours", *key, depth) in cells}
    result, done = [], set()
    for cell in cells:
        key = (cell.batch, cell.context, cell.alpha)
        if cell in result:
            continue  # the chain cell at k = depth, inserted earlier
        result.append(cell)
        if cell.kind != "ours" or key not in keys or key in done:
            continue
        if cell.k == depth or key not in has_chain:
            if cell.k != depth:
                result.append(Cell("ours", *key, depth))
            result.append(Cell("ours_tree", *key, depth))
            done.add(key)
    return result


def smoke_grid() -> list[Cell]:
    return [
        Cell("ours", 1, 64, 0.8, 2),
        Cell("ours", 2, 64, 0.8, 2),
        Cell("compiled", 1, 64),
        Cell("compiled", 2, 64),
    ]


@dataclass
class CostBook:
    """Measured seconds per cell kind (plain per shape, compiled, ours), for the budget's estimates."""

    priors: dict[str, float]
    spent: dict[str, list[tuple[int, int, float]]] = field(default_factory=dict)

    def record(self, kind: str, batch: int, context: int, seconds: float) -> None:
        self.spent.setdefault(kind, []).append((batch, context, seconds))

    def estimate(self, kind: str, batch: int, context: int) -> float:
        """The most a cell of this kind and shape cost; else, for plain / ours, the cell of its kind
        whose tokens held (batch x context) are nearest, grown by 1/32 per extra multiple of them
        (decode steps are bound by the weights; 32x the rows costs about twice); for compiled, the
        most a compile cost (it does not grow with the shape); else the prior."""
        seen = self.spent.get(kind, [])
        same = [s for b, c, s in seen if (b, c) == (batch, context)]
        if same:
            return max(same)
        if not seen:
            return self.priors[kind]
        if kind == "compiled":
            return max(s for _, _, s in seen)
        held = batch * context
        b, c, s = min(seen, key=lambda entry: abs(math.log(held / (entry[0] * entry[1]))))
        return s * (1 + max(held / (b * c) - 1, 0) / 32)


def run_grid(model, cells: list[Cell], args, started: float, results: dict) -> None:
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shapes: dict[tuple[int, int], ShapeRun] = {}
    book = CostBook(SMOKE_PRIOR_COST_S if args.cpu_smoke else PRIOR_COST_S)
    failed_shapes: set[tuple[int, int]] = set()  # plain failed there: nothing to compare with
    chains: dict[tuple, dict] = {}  # (batch, context, alpha, k): the chain arm's summary, for the tree arm
    for cell in cells:
        if cell.shape in failed_shapes:
            results["skipped"].append(
                {**asdict(cell), "reason": "the plain arm of this shape failed (see errors)"}
            )
            continue
        estimate = book.estimate(cell.kind, cell.batch, cell.context)
        if cell.shape not in shapes:
            estimate += book.estimate("plain", cell.batch, cell.context)
        elapsed = time.perf_counter() - started
        if elapsed + estimate > args.budget_s:
            results["skipped"].append({**asdict(cell), "reason": f"budget: {elapsed:.0f} s spent + ~{estimate:.0f} s "
                                       f"estimated > --budget-s {args.budget_s:.0f}"})  # fmt: skip
            print(f"skip {cell.label()}: ~{estimate:.0f} s would pass the budget", flush=True)
            continue
        try:
            if cell.shape not in shapes:
                clock = time.perf_counter()
                shapes[cell.shape] = run_plain(model, cell.batch, cell.context, args, weight_bytes)
                book.record("plain", cell.batch, cell.context, time.perf_counter() - clock)
                results["plain"][shape_key(cell.shape)] = shapes[cell.shape].plain
                print_plain(cell.shape, shapes[cell.shape].plain)
            shape = shapes[cell.shape]
            clock = time.perf_counter()
            if cell.kind == "compiled":
                shape.compiled = run_compiled(model, shape, args, weight_bytes)
                results["compiled"][shape_key(cell.shape)] = shape.compiled
                print_compiled(cell.shape, shape.compiled)
            elif cell.kind == "ours_tree":
                summary = run_ours(
                    model, shape, cell.alpha, cell.k, args, weight_bytes, widths=args.tree_widths
                )
                chain = chains.get((cell.batch, cell.context, cell.alpha, cell.k))
                results["tree_cells"].append(
                    add_tree_fields(summary, chain, args.tree_widths, args.tree_acceptance)
                )
                print_tree(summary)
            else:
                summary = run_ours(model, shape, cell.alpha, cell.k, args, weight_bytes)
                results["cells"].append(summary)
                chains[(cell.batch, cell.context, cell.alpha, cell.k)] = summary
                print_ours(summary)
            book.record(cell.kind, cell.batch, cell.context, time.perf_counter() - clock)
        except Exception as error:  # one failing arm (compile, out of memory) must not lose the others
            results["errors"].append({**asdict(cell), "error": f"{type(error).__name__}: {error}",
                                      "traceback": traceback.format_exc()})  # fmt: skip
            print(f"ERROR {cell.label()}: {type(error).__name__}: {error}", flush=True)
            if cell.shape not in shapes:
                failed_shapes.add(cell.shape)
            if model.device.type == "cuda":
                torch.cuda.empty_cache()
    # ratios to the compiled arm for ours cells that ran before their shape's compiled arm
    for summary in results["cells"] + results["tree_cells"]:
        compiled = results["compiled"].get(shape_key((summary["batch"], summary["context"])))
        if summary["ratio_vs_compiled"] is None and compiled:
            summary["ratio_vs_compiled"] = summary["tokens_per_s"] / compiled["tokens_per_s"]


def shape_key(shape: tuple[int, int]) -> str:
    return f"batch{shape[0]}_context{shape[1]}"


# --- the attention section --------------------------------------------------------------------------


def reference_paged_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_len: int,
    scale: float,
    buffers: dict,
) -> torch.Tensor:
    """Gather + SDPA, as the library's portable path: each row's blocks `index_select`ed side by side
    into reused buffers (`gather_rows`), queries `[rows, heads, query_len, dim]`, causal within the
    draft (query i of a row sits at position seq_len - query_len + i). Every row holds `query_len`
    new tokens. Returns `[rows * query_len, heads, dim]`."""
    num_rows, max_blocks = block_table.shape
    block_size, kv_heads, dim = key_pool.shape[1:]
    flat_table = block_table.reshape(-1)
    gathered = []
    for name, pool in (("key", key_pool), ("value", value_pool)):
        buffer = buffers.get(name)
        if buffer is None:
            buffer = buffers[name] = pool.new_empty((num_rows * max_blocks, block_size, kv_heads, dim))
        torch.index_select(pool, 0, flat_table, out=buffer)
        gathered.append(buffer.view(num_rows, -1, kv_heads, dim).transpose(1, 2))
    keys, values = gathered
    heads = query.shape[1]
    queries = query.view(num_rows, query_len, heads, dim).transpose(1, 2)
    mask = buffers.get("mask")
    if mask is None:
        positions = seq_lens[:, None] - query_len + torch.arange(query_len, device=query.device)  # [rows, q]
        key_index = torch.arange(keys.shape[2], device=query.device)
        mask = buffers["mask"] = key_index[None, None, None, :] <= positions[:, None, :, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=kv_heads != heads
    )
    return out.transpose(1, 2).reshape(num_rows * query_len, heads, dim)


def median_ms(function: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            clock = time.perf_counter()
            function()
            times.append((time.perf_counter() - clock) * 1000)
    return statistics.median(times)


def attention_case(
    batch: int,
    context: int,
    heads: tuple[int, int, int],
    query_len: int,
    block_size: int,
    dtype,
    device,
    seed: int,
) -> dict:
    """Random pools (blocks shuffled), queries and metadata: every row holds `context` tokens, the
    last `query_len` of them new."""
    num_heads, kv_heads, dim = heads
    blocks_per_row = -(-context // block_size)
    generator = torch.Generator(device=device).manual_seed(seed + batch * 131 + context)
    pool_shape = (batch * blocks_per_row, block_size, kv_heads, dim)
    return {
        "query": torch.randn(
            (batch * query_len, num_heads, dim), generator=generator, device=device, dtype=dtype
        ),
        "key_pool": torch.randn(pool_shape, generator=generator, device=device, dtype=dtype),
        "value_pool": torch.randn(pool_shape, generator=generator, device=device, dtype=dtype),
        # int64 metadata, as PagedKVCache.prepare_forward hands the attention
        "block_table": torch.randperm(batch * blocks_per_row, generator=generator, device=device).view(
            batch, blocks_per_row
        ),
        "query_start_loc": torch.arange(0, batch + 1, device=device, dtype=torch.int64) * query_len,
        "seq_lens": torch.full((batch,), context, device=device, dtype=torch.int64),
        "scale": dim**-0.5,
    }


def time_attention_case(
    kernel: Callable | None, batch: int, context: int, heads: tuple[int, int, int], args, device, dtype
) -> dict:
    """Reference (and kernel) times at one (batch, context), their GB/s of K / V read, max |difference|."""
    kv_bytes = 2 * batch * context * heads[1] * heads[2] * torch.finfo(dtype).bits // 8
    entry: dict = {"context": context, "batch": batch, "kv_bytes": kv_bytes}
    try:
        case = attention_case(
            batch, context, heads, args.query_len, args.block_size, dtype, device, args.seed
        )
        buffers: dict = {}

        def reference():
            return reference_paged_attention(
                case["query"], case["key_pool"], case["value_pool"], case["block_table"], case["seq_lens"],
                args.query_len, case["scale"], buffers,
            )  # fmt: skip

        def run_kernel():
            return kernel(
                case["query"], case["key_pool"], case["value_pool"], case["block_table"], case["query_start_loc"],
                case["seq_lens"], case["scale"], max_query_len=args.query_len, max_seq_len=context,
            )  # fmt: skip

        entry["reference_ms"] = median_ms(reference, device, args.attention_warmup, args.attention_repeats)
        entry["reference_kv_gb_per_s"] = kv_bytes / entry["reference_ms"] / 1e6
        if kernel is not None:
            entry["max_abs_difference"] = (run_kernel().float() - reference().float()).abs().max().item()
            entry["kernel_ms"] = median_ms(run_kernel, device, args.attention_warmup, args.attention_repeats)
            entry["kernel_kv_gb_per_s"] = kv_bytes / entry["kernel_ms"] / 1e6
            entry["speedup_vs_reference"] = entry["reference_ms"] / entry["kernel_ms"]
    except Exception as error:  # out of memory at 32k x 32 on a smaller GPU, a kernel refusing a shape
        entry["error"] = f"{type(error).__name__}: {error}"
    return entry


def run_attention_section(args, device: torch.device, dtype: torch.dtype) -> dict:
    """The kernel against gather + SDPA at each (context, batch); the kernel is imported here, and
    runs on CPU only under TRITON_INTERPRET=1."""
    heads = (args.attention_heads[0], args.attention_heads[1], args.attention_heads[2])
    section: dict = {
        "heads_kv_heads_dim": list(heads), "query_tokens_per_row": args.query_len, "block_size": args.block_size,
        "dtype": str(dtype), "warmup": args.attention_warmup, "repeats": args.attention_repeats, "cases": [],
    }  # fmt: skip
    kernel, why_not = None, None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        why_not = "on CPU the kernel runs only under Triton's interpreter: set TRITON_INTERPRET=1"
    else:
        try:
            from hf_specdec.kernels.paged_attention import paged_attention as kernel
        except Exception as error:  # not written yet, or triton missing
            why_not = f"{type(error).__name__}: {error}"
    section["kernel"] = (
        "hf_specdec.kernels.paged_attention.paged_attention" if kernel else f"not run: {why_not}"
    )
    print(f"attention: kernel {'timed' if kernel else why_not}", flush=True)
    for context in args.attention_contexts:
        for batch in args.attention_batches:
            entry = time_attention_case(kernel, batch, context, heads, args, device, dtype)
            section["cases"].append(entry)
            print_attention(entry)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return section


# --- printing ---------------------------------------------------------------------------------------


def _fmt(value, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def print_plain(shape: tuple[int, int], plain: dict) -> None:
    print(
        f"plain    b={shape[0]:<3} ctx={shape[1]:<6} {plain['tokens_per_s']:9.1f} tok/s  ttft {plain['ttft_s']:.3f} s  "
        f"step {_fmt(plain['decode_step_ms'])} ms  {plain['weights_gb_per_s']:.0f} GB/s weights",
        flush=True,
    )


def print_compiled(shape: tuple[int, int], compiled: dict) -> None:
    exact = compiled["exactness_vs_plain"]
    print(
        f"compiled b={shape[0]:<3} ctx={shape[1]:<6} {compiled['tokens_per_s']:9.1f} tok/s  "
        f"x{compiled['ratio_vs_plain']:.2f} plain  step {_fmt(compiled['decode_step_ms'])} ms  "
        f"first call {compiled['first_call_s']:.1f} s  identical rows {exact['rows'] - exact['divergent_rows']}"
        f"/{exact['rows']}  ({'compiled' if compiled['compiled'] else 'eager'})",
        flush=True,
    )


def print_ours(summary: dict) -> None:
    steps, exact = summary["per_step_ms"], summary["exactness_vs_plain"]
    print(
        f"ours     b={summary['batch']:<3} ctx={summary['context']:<6} a={summary['alpha']} k={summary['k']}  "
        f"{summary['tokens_per_s']:9.1f} tok/s  x{summary['ratio_vs_plain']:.2f} plain  "
        f"x{_fmt(summary['ratio_vs_compiled'])} compiled  tau {summary['tau']:.2f}  "
        f"alpha {summary['measured_alpha']:.2f}  decode step {_fmt(steps['decode_step'])} ms (forward "
        f"{_fmt(steps['decode_forward'])})  loop outside forward+draft {steps['loop_overhead']:.2f} ms/step  "
        f"speedup {_fmt(summary['measured_decode_speedup'])} measured / {_fmt(summary['predicted_speedup'])} "
        f"formula (c {_fmt(summary['c'], '{:.3f}')})  identical rows {exact['rows'] - exact['divergent_rows']}"
        f"/{exact['rows']}",
        flush=True,
    )


def print_tree(summary: dict) -> None:
    steps, exact, tree, chain = (
        summary["per_step_ms"],
        summary["exactness_vs_plain"],
        summary["tree"],
        summary["chain"],
    )
    print(
        f"ours_tree b={summary['batch']:<3} ctx={summary['context']:<6} a={summary['alpha']} widths "
        f"{','.join(map(str, tree['widths']))} ({tree['num_nodes']} nodes, depth {tree['depth']}, {tree['acceptance']})  "
        f"{summary['tokens_per_s']:9.1f} tok/s  x{summary['ratio_vs_plain']:.2f} plain  "
        f"x{_fmt(summary['ratio_vs_chain'])} chain  x{_fmt(summary['ratio_vs_compiled'])} compiled  "
        f"tau {summary['tau']:.2f} (chain {_fmt(chain and chain['tau'])}, expected "
        f"{summary['expected_tokens_per_step']:.2f})  nodes/step {summary['nodes_per_step']:.1f}  "
        f"verify forward {_fmt(steps['decode_forward'])} ms (chain {_fmt(chain and chain['verify_forward_ms'])}, "
        f"x{_fmt(summary['verify_forward_ratio_vs_chain'])})  decode step {_fmt(steps['decode_step'])} ms  "
        f"identical rows {exact['rows'] - exact['divergent_rows']}/{exact['rows']}",
        flush=True,
    )


def print_headlines(results: dict) -> None:
    """ours at alpha 0.8, k 4 against both plain arms, per shape that ran it."""
    for cell in results["cells"]:
        if (cell["alpha"], cell["k"]) != (0.8, 4) and not results["args"]["cpu_smoke"]:
            continue
        key = shape_key((cell["batch"], cell["context"]))
        plain, compiled = results["plain"][key], results["compiled"].get(key)
        print(
            f"HEADLINE b={cell['batch']} ctx={cell['context']} alpha={cell['alpha']} k={cell['k']}: ours "
            f"{cell['tokens_per_s']:.1f} tok/s, plain {plain['tokens_per_s']:.1f} (x{cell['ratio_vs_plain']:.2f}), "
            f"{'static+compile' if compiled and compiled['compiled'] else 'static'} "
            f"{_fmt(compiled and compiled['tokens_per_s'], '{:.1f}')} "
            f"(x{_fmt(cell['ratio_vs_compiled'])}); loop overhead {cell['per_step_ms']['loop_overhead']:.2f} ms/step; "
            f"speedup {_fmt(cell['measured_decode_speedup'])} measured vs {_fmt(cell['predicted_speedup'])} formula",
            flush=True,
        )
    for cell in results["tree_cells"]:
        chain = cell["chain"]
        print(
            f"HEADLINE tree b={cell['batch']} ctx={cell['context']} alpha={cell['alpha']} widths "
            f"{','.join(map(str, cell['tree']['widths']))} ({cell['tree']['num_nodes']} nodes): "
            f"{cell['tokens_per_s']:.1f} tok/s, x{cell['ratio_vs_plain']:.2f} plain, x{_fmt(cell['ratio_vs_chain'])} "
            f"chain (k={cell['k']}: {_fmt(chain and chain['tokens_per_s'], '{:.1f}')} tok/s); tau "
            f"{cell['tau']:.2f} vs {_fmt(chain and chain['tau'])}; verify forward "
            f"{_fmt(cell['verify_forward_ms'])} ms vs {_fmt(chain and chain['verify_forward_ms'])} ms",
            flush=True,
        )


def print_attention(entry: dict) -> None:
    print(
        f"attention b={entry['batch']:<3} ctx={entry['context']:<6} reference {_fmt(entry.get('reference_ms'), '{:.3f}')} ms"
        f"  kernel {_fmt(entry.get('kernel_ms'), '{:.3f}')} ms  x{_fmt(entry.get('speedup_vs_reference'))}"
        f"  max|diff| {_fmt(entry.get('max_abs_difference'), '{:.2e}')}"
        + (f"  {entry['error']}" if "error" in entry else ""),
        flush=True,
    )


# --- main -------------------------------------------------------------------------------------------


def ours_attention_backend(device: torch.device, choice: str | None) -> str:
    """Sets `choice` (if given) as the paged attention's backend for ours; the one it will run."""
    if choice is not None:
        os.environ["HF_SPECDEC_ATTENTION_BACKEND"] = choice
    from hf_specdec.cache import paged_attention as paged_attention_module

    resolve = getattr(paged_attention_module, "attention_backend", None)
    return resolve(device) if resolve is not None else "torch (this version has no other)"


def device_slug(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", help="comma-separated; with any of --batches/--ks/--alphas/--contexts the grid is "
                        "their full product (the others at 1,8,32,64 / 2,4,8 / 0.6,0.8,0.9 / 1k,8k)")  # fmt: skip
    parser.add_argument("--ks", help="comma-separated drafts per step")
    parser.add_argument("--alphas", help="comma-separated oracle acceptance rates")
    parser.add_argument("--contexts", help="comma-separated prompt lengths, e.g. 1k,8k")
    parser.add_argument(
        "--compile",
        choices=["headline", "all", "none"],
        default="headline",
        help="shapes that get the static cache + torch.compile arm (headline: batch 1 and 32 at 1k)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (32 in --cpu-smoke)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed calls per arm and cell, median taken (default 2; 3 in --cpu-smoke)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds from the start of main() (imports excluded, ~10 s); no cell starts that "
        "would end past it (default 255; 50 in --cpu-smoke)",
    )
    parser.add_argument(
        "--ours-attention",
        choices=["auto", "triton", "torch"],
        default=None,
        help="sets HF_SPECDEC_ATTENTION_BACKEND for ours: auto (the kernel on CUDA), triton, torch "
        "(gather + SDPA)",
    )
    parser.add_argument(
        "--tree-widths",
        default=None,
        help="the tree arm's oracle tree: children per node at each depth, e.g. 4,2,2,1 (the default; 2,1 in "
        "--cpu-smoke): sum of the products w_1..w_d nodes per row and step, compared with the chain of k = its "
        "depth; 'none': no tree arm",
    )
    parser.add_argument(
        "--tree-cells",
        choices=["headline", "all", "none"],
        default=None,
        help="where the tree arm runs: headline (the default: batch 1 and 32 at 1k, alpha 0.8), all (every "
        "batch, context and alpha of the grid; the default in --cpu-smoke), none",
    )
    parser.add_argument(
        "--tree-acceptance",
        choices=["per-candidate", "per-depth"],
        default="per-candidate",
        help="what alpha means for the tree (see OracleProposer): per-candidate (each candidate is the reference "
        "with chance alpha, given the ones ranked above are not; depth d accepts with 1 - (1 - alpha)^w_d) or "
        "per-depth (the reference is among the children with chance alpha: the chain's acceptance, more nodes)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--init-std", type=float, default=None, help="layer init std (default 0.005; 0.1 in --cpu-smoke)"
    )
    parser.add_argument(
        "--target-weights",
        choices=["decisive", "random"],
        default=None,
        help="decisive (default on GPU) or random (default in --cpu-smoke): see above",
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="default bfloat16 (float32 in --cpu-smoke)",
    )
    parser.add_argument(
        "--attention", action="store_true", help="also time the paged attention kernel vs gather + SDPA"
    )
    parser.add_argument("--attention-only", action="store_true", help="the attention section only")
    parser.add_argument(
        "--attention-contexts", default=None, help="default 1k,8k,32k (64,256 in --cpu-smoke)"
    )
    parser.add_argument("--attention-batches", default=None, help="default 1,32 (1,2 in --cpu-smoke)")
    parser.add_argument("--attention-repeats", type=int, default=None, help="default 20 (3 in --cpu-smoke)")
    parser.add_argument("--attention-warmup", type=int, default=None, help="default 5 (1 in --cpu-smoke)")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny fp32 Llama on CPU: checks the code paths"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads in --cpu-smoke (the tiny model runs fastest on one)",
    )
    parser.add_argument("--out", help="JSON path (default benchmarks/bench_gpu_<gpu-name>.json)")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    args.max_new_tokens = args.max_new_tokens or (32 if smoke else 128)
    args.repeats = args.repeats or (3 if smoke else 2)
    args.budget_s = args.budget_s if args.budget_s is not None else (50.0 if smoke else 255.0)
    args.init_std = args.init_std if args.init_std is not None else (0.1 if smoke else 0.005)
    args.target_weights = args.target_weights or ("random" if smoke else "decisive")
    args.dtype = args.dtype or ("float32" if smoke else "bfloat16")
    args.attention_contexts = parse_sizes(args.attention_contexts or ("64,256" if smoke else "1k,8k,32k"))
    args.attention_batches = parse_sizes(args.attention_batches or ("1,2" if smoke else "1,32"))
    args.attention_repeats = args.attention_repeats or (3 if smoke else 20)
    args.attention_warmup = args.attention_warmup or (1 if smoke else 5)
    args.attention_heads = (
        (4, 2, 32) if smoke else (32, 8, 128)
    )  # Llama-3.1-8B: 32 heads, 8 KV heads, dim 128
    args.query_len, args.block_size = 5, 16
    widths_text = args.tree_widths or (SMOKE_TREE_WIDTHS if smoke else TREE_WIDTHS)
    args.tree_cells = args.tree_cells or ("all" if smoke else "headline")
    if widths_text.strip().lower() == "none":
        args.tree_widths, args.tree_cells = None, "none"
    else:
        try:
            args.tree_widths = tuple(int(width) for width in widths_text.split(","))
            if min(args.tree_widths) < 1:
                raise ValueError("every width must be at least 1")
            if max(args.tree_widths) > (SMOKE_SHAPE if smoke else LLAMA_8B_SHAPE)["vocab_size"] - 1:
                raise ValueError("wider than the vocabulary's wrong tokens")
            # the carrier config the tree arm passes generate(): the library's own checks (topk, nodes, depth)
            SpeculativeConfig.from_any(carrier_config(len(args.tree_widths), args.tree_widths))
        except ValueError as error:
            parser.error(f"--tree-widths {widths_text!r}: {error}")
    if args.repeats < 1 or args.max_new_tokens < 2:
        parser.error("--repeats must be >= 1 and --max-new-tokens >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("bench_gpu.py needs a CUDA device; --cpu-smoke runs the same code paths on CPU")
    dtype = getattr(torch, args.dtype)
    shape = SMOKE_SHAPE if args.cpu_smoke else LLAMA_8B_SHAPE
    torch.manual_seed(args.seed)
    out_path = Path(
        args.out
        or Path(__file__).parent / f"bench_gpu_{'cpu-smoke' if args.cpu_smoke else device_slug(device)}.json"
    )
    results: dict = {
        "benchmark": "benchmarks/bench_gpu.py",
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "hf_specdec": hf_specdec.__version__, "python": sys.version.split()[0]},  # fmt: skip
        "commit": git_commit(),
        "args": {k: v for k, v in vars(args).items()},
        "ours_attention_backend": ours_attention_backend(device, args.ours_attention),
        "formula": FORMULA,
        "notes": NOTES,
        "plain": {}, "compiled": {}, "cells": [], "tree_cells": [], "skipped": [], "errors": [], "attention": None,
    }  # fmt: skip
    if args.cpu_smoke:
        results["compile_arm"] = (
            "skipped in --cpu-smoke: the static-cache arm runs eagerly (disable_compile=True)"
        )
    if args.attention or args.attention_only or args.cpu_smoke:
        results["attention"] = run_attention_section(args, device, dtype)
    if not args.attention_only:
        clock = time.perf_counter()
        model = build_target(shape, dtype, device, args.init_std, args.target_weights, args.seed)
        results["target"] = {
            "config": {**shape, "init_std": args.init_std, "weights": args.target_weights}, "dtype": str(dtype),
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "build_s": time.perf_counter() - clock,
        }  # fmt: skip
        print(f"target built in {results['target']['build_s']:.1f} s ({results['target']['weight_bytes'] / 1e9:.2f} GB)",
              flush=True)  # fmt: skip
        if args.cpu_smoke:
            cells = with_tree_cells(smoke_grid(), len(args.tree_widths or ()), args.tree_cells)
        elif any(getattr(args, name) for name in ("batches", "ks", "alphas", "contexts")):
            cells = explicit_grid(
                [int(b) for b in args.batches.split(",")] if args.batches else FULL_BATCHES,
                [int(k) for k in args.ks.split(",")] if args.ks else FULL_KS,
                [float(a) for a in args.alphas.split(",")] if args.alphas else FULL_ALPHAS,
                parse_sizes(args.contexts) if args.contexts else FULL_CONTEXTS,
                args.compile,
            )
            cells = with_tree_cells(cells, len(args.tree_widths or ()), args.tree_cells)
        else:
            cells = with_compile_choice(default_grid(), args.compile)
            cells = with_tree_cells(cells, len(args.tree_widths or ()), args.tree_cells)
        results["grid"] = [asdict(cell) for cell in cells]
        run_grid(model, cells, args, started, results)
    divergent = sum(cell["exactness_vs_plain"]["divergent_rows"] for cell in results["cells"])
    tree_divergent = sum(cell["exactness_vs_plain"]["divergent_rows"] for cell in results["tree_cells"])
    results["exactness"] = {
        "ours_rows": sum(cell["exactness_vs_plain"]["rows"] for cell in results["cells"]),
        "ours_divergent_rows": divergent,
        "tree_rows": sum(cell["exactness_vs_plain"]["rows"] for cell in results["tree_cells"]),
        "tree_divergent_rows": tree_divergent,
        "must_match": dtype == torch.float32,
    }
    if args.cpu_smoke:
        results["smoke_checks"] = smoke_tree_checks(results, args)
    print_headlines(results)
    if device.type == "cuda":
        results["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    results["elapsed_s"] = time.perf_counter() - started
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1, default=str))
    exact = results["exactness"]
    print(f"ours vs plain: {exact['ours_rows'] - divergent}/{exact['ours_rows']} rows identical (tree arm: "
          f"{exact['tree_rows'] - tree_divergent}/{exact['tree_rows']}); {len(results['skipped'])} cells skipped, "
          f"{len(results['errors'])} errors; {results['elapsed_s']:.1f} s; wrote {out_path}", flush=True)  # fmt: skip
    for check in results.get("smoke_checks", []):
        print(f"smoke check {'ok' if check['ok'] else 'FAILED'}: {check['check']}", flush=True)
    failed = bool(results["errors"]) or (dtype == torch.float32 and divergent + tree_divergent > 0)
    failed = failed or not all(check["ok"] for check in results.get("smoke_checks", []))
    return 1 if failed else 0


def smoke_tree_checks(results: dict, args) -> list[dict]:
    """--cpu-smoke's checks of the tree arm: it ran next to every chain cell and its output is
    plain's; its tau against the chain's at the same alpha (the two read the same draws, see
    OracleProposer): per-candidate with a width above 1 and alpha < 1: at least the chain's in every
    cell (by construction) and above it pooled over the cells of an alpha (a single short cell ties
    when no extra candidate happened to be needed); per-depth: equal in every cell."""
    if args.tree_widths is None or args.tree_cells == "none":
        return []
    chain_keys = {(cell["batch"], cell["context"], cell["alpha"]) for cell in results["cells"]}
    tree_keys = [(cell["batch"], cell["context"], cell["alpha"]) for cell in results["tree_cells"]]
    checks = [{"check": f"the tree arm ran once per (batch, context, alpha) of the chain arm ({len(tree_keys)} "
               f"cells)", "ok": sorted(tree_keys) == sorted(chain_keys)}]  # fmt: skip
    wider = args.tree_acceptance == "per-candidate" and max(args.tree_widths) > 1
    pooled: dict[
        float, list[int]
    ] = {}  # alpha: [tree accepted, tree drafting row-steps, chain ..., chain ...]
    for cell in results["tree_cells"]:
        where = f"b={cell['batch']} ctx={cell['context']} alpha={cell['alpha']}"
        exact, chain = cell["exactness_vs_plain"], cell["chain"]
        checks.append({"check": f"tree output identical to plain ({where}: {exact['rows'] - exact['divergent_rows']}"
                       f"/{exact['rows']} rows)", "ok": exact["divergent_rows"] == 0})  # fmt: skip
        if chain is None:
            checks.append({"check": f"the chain arm ran next to the tree arm ({where})", "ok": False})
            continue
        if wider and cell["alpha"] < 1:
            checks.append({"check": f"tree tau {cell['tau']:.3f} >= chain tau {chain['tau']:.3f} ({where})",
                           "ok": cell["tau"] >= chain["tau"]})  # fmt: skip
            sums = pooled.setdefault(cell["alpha"], [0, 0, 0, 0])
            for i, value in enumerate((cell["num_accepted_tokens"], cell["num_drafts"],
                                       chain["num_accepted_tokens"], chain["num_drafts"])):  # fmt: skip
                sums[i] += value
        elif args.tree_acceptance == "per-depth":
            checks.append({"check": f"tree tau {cell['tau']:.3f} == chain tau {chain['tau']:.3f} (per-depth: the "
                           f"chain's acceptance; {where})", "ok": cell["tau"] == chain["tau"]})  # fmt: skip
    for alpha, (tree_accepted, tree_drafts, chain_accepted, chain_drafts) in pooled.items():
        tree_tau, chain_tau = (
            1 + tree_accepted / max(tree_drafts, 1),
            1 + chain_accepted / max(chain_drafts, 1),
        )
        checks.append({"check": f"tree tau {tree_tau:.3f} > chain tau {chain_tau:.3f} at alpha {alpha}, pooled over "
                       "its cells", "ok": tree_tau > chain_tau})  # fmt: skip
    return checks


if __name__ == "__main__":
    sys.exit(main())
