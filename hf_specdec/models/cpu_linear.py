"""fp32 `nn.Linear` on CPU through the fastest of torch's BLAS (asked two ways), oneDNN and a
small-batch numba kernel, chosen per input row count by measuring them on the machine at hand.

Why: a decode or verify step is bound by reading the weights once, so a verify forward over
k+1 tokens should cost about what a one-token step costs. Which GEMM gets there depends on the
CPU, and no library is best everywhere:

- torch runs an fp32 CPU linear as an MKL sgemm. On the AMD EPYC machines we first measured on,
  MKL took about 2x longer for 2..9 input rows than for one (SmolLM2's 49k-row lm_head: 8.8 ms
  for 1 row, 20 ms for 2); on an Intel Xeon (AVX-512) it is the fastest route up to 3 rows
  (whole SmolLM2 forwards of 1 / 2 / 3 tokens: 40 / 45 / 47 ms) and doubles at 4 (74 ms).
- the same BLAS asked for weight @ x.T instead of x @ weight.T ("torch_t"): on that Xeon MKL then
  streams the weight once for 4 to ~48 rows (16-token forwards 124 ms against 195 as x @ weight.T
  and 138 on oneDNN), though it is the slower way for 1-3 rows.
- oneDNN, which torch ships. Handed a plain weight it packs it on every call (slow for 1-2 rows),
  so this route packs each weight once into oneDNN's blocked layout and keeps it (`_packed_weight`:
  a second copy of the weight, made only while memory allows). Packed, it streams the weight about
  as fast for 4 to 16 rows as MKL does for one: on a 2-core Xeon (AVX-512), whole forwards of
  Qwen2.5-1.5B over 1 / 4 / 9 / 16 tokens cost 230 / 269 / 327 / 387 ms, against MKL's 230 / 453 /
  628 / 668 (and 461 / 473 / 518 asked as weight @ x.T).
- `_small_batch_linear`, our numba kernel: each block of 8 weight rows is read once and dotted
  with every input row while it sits in L1 (up to `SMALL_BATCH_ROWS`). On the EPYC: SmolLM2
  forwards of 1, 2, 4 tokens 51 / 55 / 57 ms against MKL's 63 / 113 / 104 (one weight row at a
  time, as it was then). On the Xeon it wins narrowly at 4-8 rows of SmolLM2's smaller shapes
  (576x576 weights streamed from memory, 4 rows: 0.082 ms against MKL's 0.090 and oneDNN's 0.085;
  one row on MKL: 0.060).

So "auto" (`plan_backends`) times every route over passes through a network's own linears (or,
asked, over whole forwards of the model) at each row count of `PLAN_ROWS`, and each linear then
takes the route measured fastest for its row count; more rows than that (prefills) go to torch's
BLAS, as in plain `generate()`. The plan is stored per machine in the cache folder (`plan_key`:
CPU model, torch threads, torch and numba versions, routes, the linears' shapes; `plan_path`), so
only the first process with that key times anything; `plan_linears(..., replan=True)`,
`hf-specdec plan-linears` or $HF_SPECDEC_REPLAN_LINEARS time it again. A plan timed while other
processes took our cores (`_CpuWatch`) is used by that process only, never stored: on a 2-core
machine one busy process slows the routes 2-7x and unequally, which is what made "auto" plan
routes 12-40% slower in some processes. torch has no public switch for the other routes without lowering fp32 precision,
so while the context is active a module's `forward` calls them on the module's own weight (no
copy, same memory; oneDNN's packed copy excepted, above). Results are fp32 dot products like MKL's, differing only in rounding (a few
1e-6 relative); the numba kernel computes a row the same way whatever the other rows are.

`fast_cpu_linears` is public: it speeds up plain `generate()` on CPU too, and the benchmark uses it
to report how much of a speedup is speculation and how much is the GEMM.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import platform
import tempfile
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np
import torch

from ..config import CPU_LINEAR_BACKENDS
from ..tensor_parallel import tensor_parallel_group
from ..token_rows import token_positions

# the numba kernel's limit: up to here it beat oneDNN on SmolLM2's shapes on the EPYC (lm_head at
# 8 rows: 9.5 vs 13.2 ms; whole forwards of 9 / 12 / 16 tokens: 83 / 103 / 131 ms against 103 / 116 / 120)
SMALL_BATCH_ROWS = 12
# the row counts "auto" times every route at; a linear of r rows takes the route measured for the
# smallest of these >= r, and more rows than the last go to torch's BLAS
PLAN_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)
# a timing pass streams at least this much of the model's weights (`_plan_bytes`: more than the CPU's last-level cache),
# so it is bound by memory as a real forward is (a pass over cached weights favours other routes)
PLAN_BYTES = 256 * 2**20
PLAN_REPEATS = 3
# a row count timed while other processes took more than this many cores' worth of CPU from ours
# (beyond the cores our threads leave free) is timed again, up to PLAN_RETRIES more times
BUSY_CORES = 0.25
PLAN_RETRIES = 2
PLAN_RETRY_SECONDS = 10.0  # at most this long spent timing row counts again, per plan
# warm-up passes per route, at most: numba's first calls in a process cost 0.1-2 s (loading its
# compiled kernel, starting its threads), oneDNN's first builds its primitives
WARM_UP_PASSES = 5
PER_LINEAR, WHOLE_FORWARD = "per-linear", "whole-forward"  # what a plan's passes timed
# plans are stored per machine in <cache folder>/PLAN_FOLDER/ (`plan_path`); a non-empty value
# other than 0 / false / no in REPLAN_ENV makes each process time its plans again (and store them)
PLAN_FOLDER = "cpu_linear_plans"
REPLAN_ENV = "HF_SPECDEC_REPLAN_LINEARS"
PLAN_FORMAT = 3  # 2: the oneDNN route runs on packed weights; 3: the numba kernel's blocks of 8


# output features per block of `_small_batch_linear`: each input value loaded once feeds this many
# dot products (with one it was compute-bound: a 4-row pass cost 1.56x a 1-row one on the Xeon)
KERNEL_BLOCK = 8


@numba.njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True)
def _small_batch_linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """out[m, n] = x[m] . weight[n] (+ bias[n] when bias is not empty), for few rows m.

    Output features are split across threads in blocks of `KERNEL_BLOCK` weight rows; a block is
    read from memory once and reused for every input row from cache, and each input value loaded
    serves the block's 8 dot products at once. `reassoc` lets LLVM vectorise each dot product (a
    fixed summation order per output feature, the same for every row and row count); no other
    fast-math flag, so inf / nan propagate. Not `nogil`: holding the GIL keeps generate() calls in
    several Python threads from launching it at once, which numba's fallback threading layer
    (workqueue) does not survive.
    """
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    for block in numba.prange((out_features + KERNEL_BLOCK - 1) // KERNEL_BLOCK):
        n = block * KERNEL_BLOCK
        if n + KERNEL_BLOCK <= out_features:
            for m in range(num_rows):
                t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = np.float32(0.0)
                for i in range(in_features):
                    value = x[m, i]
                    t0 += value * weight[n, i]
                    t1 += value * weight[n + 1, i]
                    t2 += value * weight[n + 2, i]
                    t3 += value * weight[n + 3, i]
                    t4 += value * weight[n + 4, i]
                    t5 += value * weight[n + 5, i]
                    t6 += value * weight[n + 6, i]
                    t7 += value * weight[n + 7, i]
                out[m, n], out[m, n + 1], out[m, n + 2], out[m, n + 3] = t0, t1, t2, t3
                out[m, n + 4], out[m, n + 5], out[m, n + 6], out[m, n + 7] = t4, t5, t6, t7
        else:  # the last, partial block
            for m in range(num_rows):
                for j in range(n, out_features):
                    total = np.float32(0.0)
                    for i in range(in_features):
                        total += x[m, i] * weight[j, i]
                    out[m, j] = total
        if bias.shape[0]:
            for m in range(num_rows):
                for j in range(n, min(n + KERNEL_BLOCK, out_features)):
                    out[m, j] += bias[j]


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has the oneDNN linear op and it agrees with `F.linear`."""
    if not torch.backends.mkldnn.is_available():
        return False
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None:
        return False
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(shape, generator=generator) for shape in ((2, 3, 16), (8, 16), (8,)))
    try:
        out = op(x, weight, bias, "none", [], "")
    except RuntimeError:
        return False
    return out.shape == (2, 3, 8) and torch.allclose(out, torch.nn.functional.linear(x, weight, bias), atol=1e-5)


def _inference_fp32_cpu(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()


# each linear's weight in oneDNN's own blocked layout, made as `fast_cpu_linears` starts (or at its
# first oneDNN call) and kept while the module lives, with the (storage, version) of the weight it was made from: a weight changed in
# place (training, load_state_dict) or replaced is packed again
_PACKED_WEIGHTS: weakref.WeakKeyDictionary[torch.nn.Linear, tuple[tuple[int, int], torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
# a weight is packed only while the machine keeps this much memory available beyond its packed copy
PACK_MEMORY_MARGIN = 2 * 2**30
_UNPACKED_WARNED: list[bool] = []  # whether `_warn_unpacked` has warned in this process


def _available_memory() -> int | None:
    """Bytes the kernel reports available (MemAvailable of /proc/meminfo); None where it cannot tell."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def _warn_unpacked(available: int) -> None:
    """Once per process: which weights are left unpacked and why."""
    if _UNPACKED_WARNED:
        return
    _UNPACKED_WARNED.append(True)
    warnings.warn(
        f"cpu_linear: {available / 2**30:.1f} GiB of memory available, too little to keep oneDNN's packed copy of "
        f"a linear's weight (PACK_MEMORY_MARGIN {PACK_MEMORY_MARGIN / 2**30:.0f} GiB beyond it): oneDNN packs such "
        "weights on every call, slower for few rows",
        stacklevel=4,
    )


def _packed_weight(linear: torch.nn.Linear) -> torch.Tensor:
    """`linear.weight` in oneDNN's blocked layout (packed once, `_PACKED_WEIGHTS`), or the weight
    itself (oneDNN then packs it per call, as before) where a copy would leave less than
    `PACK_MEMORY_MARGIN` available: the packed copy is as large as the weight."""
    weight = linear.weight
    stamp = (weight.data_ptr(), weight._version)
    held = _PACKED_WEIGHTS.get(linear)
    if held is not None and held[0] == stamp:
        return held[1]
    available = _available_memory()
    if available is not None and available < weight.numel() * weight.element_size() + PACK_MEMORY_MARGIN:
        _PACKED_WEIGHTS.pop(linear, None)
        _warn_unpacked(available)
        return weight
    packed = _reorder(weight.detach())
    _PACKED_WEIGHTS[linear] = (stamp, packed)
    return packed


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not _inference_fp32_cpu(x):
        return torch.nn.functional.linear(x, self.weight, self.bias)  # the op has no autograd
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _packed_weight(self), self.bias, "none", [], "")


def _torch_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, self.weight, self.bias)


def _torch_transposed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The same product as `F.linear`, asked of the BLAS as weight @ x.T: for 4 to ~48 rows MKL
    streams the weight once this way, where its x @ weight.T path slows down (see the module doc)."""
    rows = x.numel() // self.in_features
    x_t = x.reshape(rows, self.in_features).t()
    out_t = torch.mm(self.weight, x_t) if self.bias is None else torch.addmm(self.bias.unsqueeze(1), self.weight, x_t)
    return out_t.t().contiguous().view(*x.shape[:-1], self.out_features)


def _numba_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // self.in_features
    if not _inference_fp32_cpu(x) or rows > SMALL_BATCH_ROWS:
        return _onednn_forward(self, x) if onednn_available() else torch.nn.functional.linear(x, self.weight, self.bias)
    weight, bias = _numpy_arrays(self)
    out = torch.empty(rows, self.out_features, dtype=torch.float32)
    _small_batch_linear(np.ascontiguousarray(x.numpy()).reshape(rows, self.in_features), weight, bias, out.numpy())
    return out.view(*x.shape[:-1], self.out_features)


_NO_BIAS = np.empty(0, dtype=np.float32)
# each linear's weight and bias as NumPy arrays (views of the same memory: a change in place shows), with the
# addresses they were taken from (a replaced weight or bias is taken again): taken once, not per call (a SmolLM2
# forward makes 211 calls; per call, one row, on 2 threads: 27 -> 22 us for a 64x64 linear, 48 -> 44 us for 576x576)
_NUMPY_ARRAYS: weakref.WeakKeyDictionary[torch.nn.Linear, tuple[tuple[int, int], np.ndarray, np.ndarray]] = (
    weakref.WeakKeyDictionary()
)


def _numpy_arrays(linear: torch.nn.Linear) -> tuple[np.ndarray, np.ndarray]:
    weight, bias = linear.weight, linear.bias
    stamp = (weight.data_ptr(), 0 if bias is None else bias.data_ptr())
    held = _NUMPY_ARRAYS.get(linear)
    if held is None or held[0] != stamp:
        held = _NUMPY_ARRAYS[linear] = (stamp, weight.detach().numpy(), _NO_BIAS if bias is None else bias.detach().numpy())
    return held[1], held[2]


@functools.cache
def _load_numba_kernel() -> None:
    """Compile (or load from numba's cache) `_small_batch_linear` for the arrays `_numba_forward`
    passes, once per process. Done when a route first takes it: loading alone costs ~0.4 s on a
    2-core VM, and at the first call it landed inside a decode step (SmolLM2's EAGLE-3 head at
    batch 8: a 100 ms step took 470 ms, which auto k read as the price of drafting)."""
    x = np.zeros((1, 1), dtype=np.float32)
    _small_batch_linear(x, x, _NO_BIAS, np.empty((1, 1), dtype=np.float32))


_FORWARDS: dict[str, Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]] = {
    "numba": _numba_forward,
    "onednn": _onednn_forward,
    "torch": _torch_forward,
    "torch_t": _torch_transposed_forward,
}


@dataclass(frozen=True)
class BackendPlan:
    """The route "auto" runs a linear through, by its number of input rows (and how that was found)."""

    rows: tuple[int, ...]  # ascending row counts that were measured
    backends: tuple[str, ...]  # the fastest route measured at each
    # the fastest pass of each route at each row count, seconds (a pass: every linear once, or a forward)
    timings: dict[int, dict[str, float]] = field(default_factory=dict, compare=False)
    method: str = PER_LINEAR  # PER_LINEAR or WHOLE_FORWARD
    disturbed: tuple[int, ...] = field(default=(), compare=False)  # row counts timed while others took our cores
    seconds: float = field(default=0.0, compare=False)  # how long the timing took
    source: str = field(default="timed", compare=False)  # "timed" in this process, or "stored" (read from `path`)
    path: str | None = field(default=None, compare=False)  # the file it is stored in, if it is
    key: dict | None = field(default=None, compare=False, repr=False)  # `plan_key` of the linears it was made for
    # per-linear plans: each weight shape's ("out x in", `shape_name`) own fastest route per row
    # count, timed inside the same passes (`backends`: the fastest for all linears together). Why: on a 2-core Xeon at 4 rows SmolLM2's LM head is 2x faster on oneDNN while its
    # decoder linears are faster on MKL; at 24 rows Qwen2.5-1.5B's linears take three routes.
    shape_backends: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def backend_for(self, rows: int, shape: str | None = None) -> str:
        """The route measured at the smallest row count >= `rows` (for linears of `shape`, where
        the plan has one of its own); "torch" past the last one."""
        index = bisect.bisect_left(self.rows, rows)
        return self.shape_backends.get(shape, self.backends)[index] if index < len(self.rows) else "torch"

    def describe(self) -> str:
        """E.g. "rows 1-3: torch, 4: numba, 5-32: onednn, more: torch; 49152x576: rows 1: torch, 2-32:
        onednn, more: torch" (the shapes whose routes differ from all linears' together)."""
        text = _describe_routes(self.rows, self.backends)
        return "; ".join([text] + [f"{shape}: {_describe_routes(self.rows, routes)}"
                                   for shape, routes in sorted(self.shape_backends.items()) if routes != self.backends])  # fmt: skip

    def table(self) -> str:
        """The timings (ms, fastest pass of each route) and the route chosen, one line per row count."""
        routes = [route for route in ROUTE_ORDER if any(route in by_route for by_route in self.timings.values())]
        what = "whole forward" if self.method == WHOLE_FORWARD else "pass over all linears"
        lines = [f"{'rows':>5} " + " ".join(f"{route:>8}" for route in routes) + f"   chosen  (ms per {what})"]
        for rows, backend in zip(self.rows, self.backends):
            by_route = self.timings.get(rows, {})
            cells = " ".join(f"{by_route[route] * 1e3:8.2f}" if route in by_route else f"{'-':>8}" for route in routes)
            busy = "  (machine busy while timed)" if rows in self.disturbed else ""
            lines.append(f"{rows:>5} {cells}   {backend}{busy}")
        return "\n".join(lines)


def _describe_routes(rows: Sequence[int], backends: Sequence[str]) -> str:
    spans, first = [], 1
    for index, (count, backend) in enumerate(zip(rows, backends)):
        if index + 1 < len(rows) and backends[index + 1] == backend:
            continue
        spans.append(f"{first}{'' if first == count else f'-{count}'}: {backend}")
        first = count + 1
    return "rows " + ", ".join(spans) + ", more: torch"


def shape_name(linear: torch.nn.Linear) -> str:
    """A linear's weight shape as plans name it: "out_features x in_features", e.g. "49152x576"."""
    return f"{linear.out_features}x{linear.in_features}"


# pass timer: (route, rows, linears) -> seconds for one forward of every linear with `rows` input rows,
# in all or by weight shape
PassTimer = Callable[[str, int, Sequence[torch.nn.Linear]], float | dict[str, float]]
_PLANS: dict[str, BackendPlan] = {}  # by plan key (`plan_key`, as JSON): loaded or timed once per process


def _time_pass(
    backend: str, rows: int, linears: Sequence[torch.nn.Linear], weights: Sequence[float] | None = None
) -> dict[str, float]:
    """Seconds for one call of every linear with `rows` input rows, in their order, by weight shape
    (`shape_name`); with `weights`, each linear's time counts that many times (a sample standing
    for all the linears of a network). Every shape is timed inside the one pass over all of them,
    so that each streams its weights from memory as in a forward (a pass over one shape's few
    linears would time them from the cache)."""
    inputs = {n: torch.randn(1, rows, n) for n in {linear.in_features for linear in linears}}
    forward = _FORWARDS[backend]
    by_shape: dict[str, float] = {}
    for index, linear in enumerate(linears):
        started = time.perf_counter()
        forward(linear, inputs[linear.in_features])
        seconds = (time.perf_counter() - started) * (1.0 if weights is None else weights[index])
        by_shape[shape_name(linear)] = by_shape.get(shape_name(linear), 0.0) + seconds
    return by_shape


def _total(seconds: float | dict[str, float]) -> float:
    """A pass's seconds: a pass timer gives them in all (a whole forward) or by weight shape."""
    return sum(seconds.values()) if isinstance(seconds, dict) else seconds


@functools.cache
def _plan_bytes() -> int:
    """How much of a network's weights a timing pass streams: `PLAN_BYTES`, or twice the CPU's
    last-level cache where that is larger (a VM on a 2-core slice of a Xeon reports the host's
    480 MiB L3: passes over 256 MiB timed the routes on cached weights, and picked MKL's weight @ x.T
    for Qwen2.5-1.5B's MLP at 9 rows, 1.5x slower than oneDNN there in real forwards)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
            sizes.append((level, int(size[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[size[-1]]))
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return max(PLAN_BYTES, 2 * max(sizes)[1]) if sizes else PLAN_BYTES


def _sample(linears: Sequence[torch.nn.Linear]) -> tuple[list[torch.nn.Linear], list[float] | None]:
    """About `PLAN_BYTES` of `linears`, every shape among them in proportion to its count (at least
    one of each: the LM head too), in the model's order, and what each stands for (None: all taken).

    Before, the sample was the first `PLAN_BYTES` in module order, which left the LM head out (it
    comes last): on SmolLM2 a fifth of a forward's weights, and a shape whose best route differs
    (on a 2-core Xeon oneDNN from 4 rows, where the decoder layers' linears prefer MKL)."""
    sizes = [linear.weight.numel() * linear.weight.element_size() for linear in linears]
    budget = _plan_bytes()
    if sum(sizes) <= budget:
        return list(linears), None
    fraction = budget / sum(sizes)
    groups: dict[tuple, list[torch.nn.Linear]] = {}
    for linear in linears:
        groups.setdefault((linear.in_features, linear.out_features, linear.bias is not None), []).append(linear)
    taken, weight = set(), {}
    for members in groups.values():
        count = max(1, round(len(members) * fraction))
        taken.update(id(linear) for linear in members[:count])
        weight.update({id(linear): len(members) / count for linear in members})
    sample = [linear for linear in linears if id(linear) in taken]
    return sample, [weight[id(linear)] for linear in sample]


def _whole_forward_timer(network: torch.nn.Module, linears: Sequence[torch.nn.Linear]) -> PassTimer:
    """A pass timer that runs the network's own forward (input_ids of `rows` tokens, no cache) with
    every one of `linears` on the route: what a decode / verify step costs, attention, norms and the
    LM head included."""
    embeddings = network.get_input_embeddings() if hasattr(network, "get_input_embeddings") else None
    if embeddings is None or not hasattr(embeddings, "num_embeddings"):
        raise ValueError(
            f"whole-forward planning needs a model whose forward takes input_ids; {type(network).__name__} "
            "has no input embeddings (plan its linears one by one instead)"
        )
    generator = torch.Generator().manual_seed(0)
    tokens: dict[int, torch.Tensor] = {}

    def time_forward(route: str, rows: int, _linears: Sequence[torch.nn.Linear]) -> float:
        if rows not in tokens:
            tokens[rows] = torch.randint(0, embeddings.num_embeddings, (1, rows), generator=generator)
        forward = _FORWARDS[route]
        for linear in linears:
            linear.forward = types.MethodType(forward, linear)
        try:
            started = time.perf_counter()
            network(input_ids=tokens[rows], use_cache=False)
            return time.perf_counter() - started
        finally:
            for linear in linears:
                linear.__dict__.pop("forward", None)

    return time_forward


class _CpuWatch:
    """How much CPU other processes took from the cores torch's threads run on, while timing.

    Read from /proc/stat (Linux), for the CPUs this process may run on: their busy time (steal
    included: a VM's host running someone else) less this process's own CPU time, in cores, beyond
    the cores our threads leave free. One competing busy process on a 2-core machine makes a
    2-thread pass 2-7x slower and not alike for every route (MKL more than numba), so a plan timed
    then is a random one. None where it cannot be told (no /proc/stat, or a window too short to
    judge at /proc/stat's 10 ms resolution)."""

    MIN_WINDOW_S = 0.2

    def __init__(self) -> None:
        try:
            self.cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = list(range(os.cpu_count() or 1))
        self.ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.start = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as stat:
                lines = stat.read().splitlines()
        except OSError:
            return None
        wanted, busy = {f"cpu{cpu}" for cpu in self.cpus}, 0
        for line in lines:
            fields = line.split()
            if fields and fields[0] in wanted:
                # user nice system idle iowait irq softirq steal ...: all but idle and iowait
                busy += sum(int(value) for value in fields[1:4]) + sum(int(value) for value in fields[6:9])
        return busy / self.ticks_per_s, time.process_time(), time.perf_counter()

    def others_cores(self) -> float | None:
        """Cores' worth of CPU others took since the start, beyond the ones we leave free (None: unknown)."""
        end = self._read()
        if self.start is None or end is None or end[2] - self.start[2] < self.MIN_WINDOW_S:
            return None
        wall = end[2] - self.start[2]
        others = (end[0] - self.start[0]) - (end[1] - self.start[1])
        spare = max(0, len(self.cpus) - torch.get_num_threads())
        return max(0.0, others / wall - spare)


ROUTE_ORDER = ("torch", "torch_t", "onednn", "numba")


def _routes() -> list[str]:
    """The routes "auto" chooses among here, in `ROUTE_ORDER`."""
    return [route for route in ROUTE_ORDER if route != "onednn" or onednn_available()]


def plan_backends(
    linears: Sequence[torch.nn.Linear], rows: Sequence[int] = PLAN_ROWS, time_pass: PassTimer = _time_pass,
    repeats: int = PLAN_REPEATS, method: str = PER_LINEAR,
) -> BackendPlan:
    """Time torch's BLAS (as x @ weight.T and as weight @ x.T), oneDNN (where torch has it) and
    the numba kernel (up to `SMALL_BATCH_ROWS` rows) over passes through `linears` (or whatever
    `time_pass` times: whole forwards, `_whole_forward_timer`) at each row count; the fastest of
    `repeats` passes, taken in a rotating order so that drift hits every route alike, picks the
    route for that count. The fastest pass, not the median: a disturbance only ever adds time.
    Where `time_pass` times each weight shape too (`_time_pass`), each shape also gets the route
    fastest for it (`BackendPlan.shape_backends`, from its fastest time among the passes).

    A row count during which other processes took our cores (`_CpuWatch`: such a disturbance slows
    the routes unequally, so no pass of it can be trusted) is timed again, up to `PLAN_RETRIES`
    times (`PLAN_RETRY_SECONDS` in all); if it stays busy, its row count is listed in `disturbed`
    (and the plan is not stored), and the row counts after it are timed once each.
    """
    routes = _routes()
    started = time.perf_counter()
    chosen, timings, disturbed, retried_s = [], {}, [], 0.0
    shape_timings: dict[str, dict[int, dict[str, float]]] = {}  # shape -> rows -> route -> fastest seconds
    with torch.no_grad():
        for route in routes:  # first calls pay one-time costs (numba loading its kernel, starting its threads)
            previous = _total(time_pass(route, 1, linears))
            for _ in range(WARM_UP_PASSES - 1):  # until a pass costs what the one before did
                latest = _total(time_pass(route, 1, linears))
                if latest > 0.8 * previous:
                    break
                previous = latest
        for count in rows:
            candidates = [r for r in routes if r != "numba" or count <= SMALL_BATCH_ROWS]
            best, best_busy = None, None
            for attempt in range(1 + PLAN_RETRIES):
                if attempt and (disturbed or retried_s > PLAN_RETRY_SECONDS):
                    break  # a machine that stayed busy: no more waiting for it
                attempt_started = time.perf_counter()
                watch = _CpuWatch()
                seconds: dict[str, list[float | dict[str, float]]] = {route: [] for route in candidates}
                for repeat in range(repeats):
                    shift = repeat % len(candidates)
                    for route in candidates[shift:] + candidates[:shift]:
                        seconds[route].append(time_pass(route, count, linears))
                busy = watch.others_cores()
                if attempt:
                    retried_s += time.perf_counter() - attempt_started
                if best is None or (busy is not None and best_busy is not None and busy < best_busy):
                    best, best_busy = seconds, busy
                if busy is None or busy <= BUSY_CORES:
                    break
            if best_busy is not None and best_busy > BUSY_CORES:
                disturbed.append(count)
            timings[count] = {route: min(map(_total, values)) for route, values in best.items()}
            chosen.append(min(candidates, key=lambda route: timings[count][route]))
            for route, values in best.items():
                for one_pass in values:
                    for shape, shape_seconds in (one_pass.items() if isinstance(one_pass, dict) else ()):
                        fastest = shape_timings.setdefault(shape, {}).setdefault(count, {})
                        fastest[route] = min(fastest.get(route, shape_seconds), shape_seconds)
    shape_backends = {
        shape: tuple(min(by_rows[count], key=by_rows[count].get) for count in rows) for shape, by_rows in shape_timings.items()
    } if len(shape_timings) > 1 else {}  # fmt: skip
    return BackendPlan(
        rows=tuple(rows), backends=tuple(chosen), timings=timings, method=method, disturbed=tuple(disturbed),
        seconds=time.perf_counter() - started, shape_backends=shape_backends,
    )  # fmt: skip


# --- plans stored per machine ---------------------------------------------------------------------
@functools.cache
def _cpu_name() -> str:
    """The CPU model, e.g. "Intel(R) Xeon(R) Processor (family 6, model 143, stepping 8), 2 CPUs"."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip() and fields:
                    break  # the first processor's block is enough
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    ids = ", ".join(f"{field} {fields[field]}" for field in ("cpu family", "model", "stepping") if field in fields)
    return f"{name}{f' ({ids})' if ids else ''}, {os.cpu_count()} CPUs"


def plan_key(linears: Sequence[torch.nn.Linear]) -> dict:
    """What a plan depends on: the machine (CPU model, torch threads), the software (torch, numba),
    the routes it chose among and the linears (in, out, dtype, how many of each)."""
    shapes = collections.Counter(
        (linear.in_features, linear.out_features, str(linear.weight.dtype).removeprefix("torch.")) for linear in linears
    )
    return {
        "format": PLAN_FORMAT,
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "numba": numba.__version__,
        "routes": _routes(),
        "small_batch_rows": SMALL_BATCH_ROWS,
        "linears": sorted([in_features, out_features, dtype, count] for (in_features, out_features, dtype), count in shapes.items()),
    }  # fmt: skip


def plan_path(key: dict) -> Path:
    """The file a plan of `key` is stored in: <cache folder>/cpu_linear_plans/<hash of key>.json, the
    cache folder being `real_models.cache_dir()` ($HF_SPECDEC_CACHE, else ~/.cache/hf_specdec)."""
    from .real_models import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / PLAN_FOLDER / f"{digest}.json"


def _load_plan(key: dict) -> BackendPlan | None:
    """The stored plan of `key`; None when there is none, or (with a warning) when it cannot be read."""
    path = plan_path(key)
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            raise ValueError("it was stored for another key")
        stored = data["plan"]
        rows = tuple(int(count) for count in stored["rows"])
        backends = tuple(str(backend) for backend in stored["backends"])
        if not rows or len(rows) != len(backends) or list(rows) != sorted(set(rows)) or rows[0] < 1:
            raise ValueError(f"rows {list(rows)} and routes {list(backends)} do not form a plan")
        shape_backends = {
            str(shape): tuple(str(backend) for backend in routes)
            for shape, routes in stored.get("shape_backends", {}).items()
        }
        if any(len(routes) != len(rows) for routes in shape_backends.values()):
            raise ValueError(f"a shape's routes {shape_backends} do not match the row counts {list(rows)}")
        unknown = (set(backends) | {route for routes in shape_backends.values() for route in routes}) - set(key["routes"])
        if unknown:
            raise ValueError(f"routes {sorted(unknown)} are not among {key['routes']}")
        timings = {
            int(count): {str(route): float(ms) / 1e3 for route, ms in by_route.items()}
            for count, by_route in stored.get("timings_ms", {}).items()
        }
        method = stored.get("method", PER_LINEAR)
        seconds = float(stored.get("planning_s", 0.0))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(
            f"ignoring the stored CPU linear plan {path}, which cannot be used ({error}); timing the routes again",
            stacklevel=3,
        )
        return None
    return BackendPlan(
        rows, backends, timings, method, seconds=seconds, source="stored", path=str(path), key=key,
        shape_backends=shape_backends,
    )  # fmt: skip


def _store_plan(key: dict, plan: BackendPlan) -> str | None:
    """Writes `plan` to `plan_path(key)` through a temporary file and a rename, so that a reader never
    sees half a file whatever other processes write at once; returns the path (None, with a warning,
    where the cache folder cannot be written)."""
    path = plan_path(key)
    try:
        load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    except (AttributeError, OSError):
        load = None
    data = {
        "key": key,
        "plan": {
            "rows": list(plan.rows),
            "backends": list(plan.backends),
            "shape_backends": {shape: list(routes) for shape, routes in plan.shape_backends.items()},
            "text": plan.describe(),
            "method": plan.method,
            "timings_ms": {
                str(count): {route: round(s * 1e3, 4) for route, s in by_route.items()}
                for count, by_route in plan.timings.items()
            },
            "planning_s": round(plan.seconds, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_average": load,
        },
    }
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(data, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        temporary = None
    except OSError as error:
        warnings.warn(f"could not store the CPU linear plan in {path} ({error}); it holds for this process only", stacklevel=3)
        return None
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    return str(path)


def _replan_from_env() -> bool:
    return os.environ.get(REPLAN_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _plan_for(
    network: torch.nn.Module, linears: Sequence[torch.nn.Linear], *, replan: bool = False,
    rows: Sequence[int] | None = None, whole_forward: bool = False, repeats: int = PLAN_REPEATS,
) -> BackendPlan:
    """The plan for `network`'s fp32 CPU `linears`: from this process's memory, else from the stored
    file of its key, else timed (over a sample of the linears, or whole forwards of `network`) and
    stored. `replan` (or $HF_SPECDEC_REPLAN_LINEARS on a process's first use) times it again;
    `rows` other than the stored plan's also do."""
    key = plan_key(linears)
    memo = json.dumps(key, sort_keys=True)
    if not replan:
        plan = _PLANS.get(memo)
        if plan is None and not _replan_from_env():
            plan = _load_plan(key)
        if plan is not None and (rows is None or plan.rows == tuple(rows)):
            _PLANS[memo] = plan
            return plan
    rows = tuple(rows or PLAN_ROWS)
    if whole_forward:
        plan = plan_backends(linears, rows, _whole_forward_timer(network, linears), repeats, method=WHOLE_FORWARD)
    else:
        sample, weights = _sample(linears)
        plan = plan_backends(sample, rows, functools.partial(_time_pass, weights=weights), repeats)
    if plan.disturbed:
        warnings.warn(
            f"other processes took this machine's cores while the CPU linear routes were timed at {list(plan.disturbed)} "
            f"rows: the plan ({plan.describe()}) holds for this process only and is not stored; time it again on a "
            "quiet machine (hf-specdec plan-linears)",
            stacklevel=3,
        )
        plan = dataclasses.replace(plan, key=key)
    else:
        plan = dataclasses.replace(plan, key=key, path=_store_plan(key, plan))
    _PLANS[memo] = plan
    return plan


def plan_linears(
    networks: torch.nn.Module | Iterable[torch.nn.Module], *, replan: bool = False, rows: Sequence[int] | None = None,
    whole_forward: bool = False, repeats: int = PLAN_REPEATS,
) -> list[BackendPlan | None]:
    """The "auto" plan of each network's fp32 CPU linears (None for one that has none), the one
    `fast_cpu_linears` and speculative generate() then use: the stored plan of this machine where
    there is one (milliseconds), else timed and stored. `replan=True` times it again and replaces
    the stored one; `whole_forward=True` times whole forwards of each network (input_ids of 1..N
    tokens, every linear on one route) instead of passes over its linears, ~2x the time. `rows`:
    the row counts to time (default `PLAN_ROWS`)."""
    networks = [networks] if isinstance(networks, torch.nn.Module) else list(networks)
    plans = []
    with torch.no_grad(), _numba_threads_like_torch():
        for network, linears in _linears_by_network(networks):
            plans.append(
                _plan_for(network, linears, replan=replan, rows=rows, whole_forward=whole_forward, repeats=repeats)
                if linears else None
            )  # fmt: skip
    return plans


def linear_plan(*modules: torch.nn.Module) -> BackendPlan | None:
    """The plan `fast_cpu_linears(*modules)` ("auto") runs the first of them with fp32 CPU linears by
    (stored, or timed on first use); None when they have none."""
    return next((plan for plan in plan_linears(modules) if plan is not None), None)


@contextlib.contextmanager
def _numba_threads_like_torch() -> Iterator[None]:
    """numba's kernel threads follow `torch.get_num_threads()` inside the block, and torch keeps its
    count: numba's OpenMP pool, launched on its first use in a process, resets OpenMP's thread count
    to NUMBA_NUM_THREADS, so torch set to 1 thread ran (and planned, and keyed its plan) at 2."""
    threads = torch.get_num_threads()
    numba_threads = numba.get_num_threads()  # launches numba's pool on first use
    try:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        yield
    finally:
        numba.set_num_threads(numba_threads)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _planned_forward(self: torch.nn.Linear, routes: tuple, x: torch.Tensor) -> torch.Tensor:
    """`routes[rows]`: the plan's forward for that many rows (`_route_table`); torch's past its end.
    Runs for every linear of every forward, so it checks as little as it can (a few µs matter here).
    In a forward padded between its tokens (`token_rows.py`), only the token positions are computed."""
    positions = token_positions(x)
    if positions is not None:
        flat = x.reshape(-1, self.in_features)
        out = flat.new_zeros(flat.shape[0], self.out_features)
        out.index_copy_(0, positions, _planned_forward(self, routes, flat.index_select(0, positions)))
        return out.view(*x.shape[:-1], self.out_features)
    rows = x.numel() // self.in_features
    if rows < len(routes) and x.dtype is torch.float32 and x.is_cpu and not torch.is_grad_enabled():
        return routes[rows](self, x)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def _route_table(plan: BackendPlan, shape: str | None = None) -> tuple:
    return tuple(_FORWARDS[plan.backend_for(rows, shape)] for rows in range(plan.rows[-1] + 1))


def resolve_backend(backend: str, modules: Iterable[torch.nn.Module]) -> str:
    """The backend the loop runs, "auto", "numba", "onednn" or "torch", for the configured `backend`.

    "auto" stays "auto" (measured routes) when `modules` hold some fp32 CPU linear, else it is
    "torch"; "torch" too when one of them is tensor-parallel: each rank would time its own routes,
    and a drafter whose rounding differs between ranks could draft different tokens on them.
    "onednn" where torch has no oneDNN raises, naming the allowed values.
    """
    if backend not in CPU_LINEAR_BACKENDS:
        raise ValueError(f"cpu_linear_backend={backend!r} is unknown; allowed: {', '.join(CPU_LINEAR_BACKENDS)}")
    if backend == "onednn" and not onednn_available():
        raise ValueError(
            "cpu_linear_backend='onednn' but this torch build has no working oneDNN linear; "
            "allowed here: 'auto', 'numba' or 'torch'"
        )
    if backend != "auto":
        return backend
    modules = list(modules)
    if any(tensor_parallel_group(module) is not None for module in modules):
        return "torch"
    return "auto" if next(_fp32_cpu_linears(modules), None) is not None else "torch"


def _linears_by_network(modules: Iterable[torch.nn.Module]) -> list[tuple[torch.nn.Module, list[torch.nn.Linear]]]:
    """(module, its fp32 CPU linears not already in an earlier one) for each of `modules`: each
    network (the target, a drafter) gets a plan of its own, stored under its own linears' shapes."""
    seen: set[int] = set()
    networks = []
    for module in modules:
        linears = [linear for linear in _fp32_cpu_linears([module]) if id(linear) not in seen]
        seen.update(id(linear) for linear in linears)
        networks.append((module, linears))
    return networks


def _fp32_cpu_linears(modules: Iterable[torch.nn.Module]) -> Iterator[torch.nn.Linear]:
    seen = set()
    for root in modules:
        for module in root.modules():
            weight = getattr(module, "weight", None)
            if (
                isinstance(module, torch.nn.Linear)
                and type(module).forward is torch.nn.Linear.forward  # a subclass may compute more
                and id(module) not in seen
                and weight.dtype == torch.float32
                and weight.device.type == "cpu"
                and weight.is_contiguous()
                and isinstance(module.in_features, int)  # Inkling's vision tower sets tensors there
                and "forward" not in module.__dict__  # already patched, or someone else's override
            ):
                seen.add(id(module))
                yield module


FAST_BACKENDS = ("auto", "numba", "onednn")


@contextlib.contextmanager
def fast_cpu_linears(*modules: torch.nn.Module, backend: str = "auto") -> Iterator[None]:
    """Inside the block, every fp32 CPU `nn.Linear` of `modules` runs through `backend`: "auto"
    (per row count, the route measured fastest here: `plan_backends`, run once per process and
    model, a few seconds for a 135M model), "numba" (up to `SMALL_BATCH_ROWS` rows in our kernel,
    more through oneDNN) or "onednn" (an error where this torch has none). Inference only: with
    grad enabled they fall back to `F.linear`. numba's threads follow `torch.get_num_threads()`
    meanwhile.

    >>> with torch.no_grad(), fast_cpu_linears(model):
    ...     model.generate(**inputs)
    """
    if backend not in FAST_BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; allowed: {', '.join(FAST_BACKENDS)}")
    resolve_backend(backend, modules)  # raises where oneDNN is demanded but missing
    networks = _linears_by_network(modules)
    patched = [linear for _, linears in networks for linear in linears]
    with _numba_threads_like_torch():
        try:
            for network, linears in networks:
                plan = _plan_for(network, linears) if backend == "auto" and linears else None
                tables = {}  # by shape
                for linear in linears:
                    if plan is None:
                        linear.forward = types.MethodType(_FORWARDS[backend], linear)
                        routes = {backend}
                    else:
                        shape = shape_name(linear)
                        if shape not in tables:
                            tables[shape] = _route_table(plan, shape)
                        linear.forward = functools.partial(_planned_forward, linear, tables[shape])
                        routes = set(plan.shape_backends.get(shape, plan.backends))
                    if "onednn" in routes:
                        # packed now, not at the first oneDNN call: packing costs a one-time ~5 s per GB of
                        # weights on a 2-core VM (fresh memory), which landed in the middle of a decode
                        _packed_weight(linear)
                    if "numba" in routes:
                        _load_numba_kernel()
            yield
        finally:
            for linear in patched:
                linear.__dict__.pop("forward", None)
