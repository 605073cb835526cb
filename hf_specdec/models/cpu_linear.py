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
- oneDNN, which torch ships, packs the weight on every call: slow for 1-2 rows, the best from
  about 6 rows on (Xeon: 73 ms for 6 tokens, 89 for 16).
- `_small_batch_linear`, our numba kernel: each weight row is read once and dotted with every
  input row while it sits in L1 (up to `SMALL_BATCH_ROWS`). On the EPYC: SmolLM2 forwards of 1,
  2, 4 tokens 51 / 55 / 57 ms against MKL's 63 / 113 / 104; on the Xeon 47 / 56 / 69.

So "auto" (`plan_backends`) times every route once per process over a pass through the model's
own linears at each row count of `PLAN_ROWS`, and each linear then takes the route measured
fastest for its row count; more rows than that (prefills) go to torch's BLAS, as in plain
`generate()`. torch has no public switch for the other routes without lowering fp32 precision,
so while the context is active a module's `forward` calls them on the module's own weight (no
copy, same memory). Results are fp32 dot products like MKL's, differing only in rounding (a few
1e-6 relative); the numba kernel computes a row the same way whatever the other rows are.

`fast_cpu_linears` is public: it speeds up plain `generate()` on CPU too, and the benchmark uses it
to report how much of a speedup is speculation and how much is the GEMM.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numba
import numpy as np
import torch

from ..config import CPU_LINEAR_BACKENDS

# the numba kernel's limit: up to here it beat oneDNN on SmolLM2's shapes on the EPYC (lm_head at
# 8 rows: 9.5 vs 13.2 ms; whole forwards of 9 / 12 / 16 tokens: 83 / 103 / 131 ms against 103 / 116 / 120)
SMALL_BATCH_ROWS = 12
# the row counts "auto" times every route at; a linear of r rows takes the route measured for the
# smallest of these >= r, and more rows than the last go to torch's BLAS
PLAN_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# a timing pass streams up to this much of the model's weights: more than a CPU's last-level cache,
# so it is bound by memory as a real forward is (a pass over cached weights favours other routes)
PLAN_BYTES = 256 * 2**20
PLAN_REPEATS = 3


@numba.njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True)
def _small_batch_linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """out[m, n] = x[m] . weight[n] (+ bias[n] when bias is not empty), for few rows m.

    Output features are split across threads; each weight row is read from memory once and reused
    for every input row from cache. `reassoc` lets LLVM vectorise the dot product (a fixed
    summation order, the same for every row); no other fast-math flag, so inf / nan propagate.
    Not `nogil`: holding the GIL keeps generate() calls in several Python threads from launching
    it at once, which numba's fallback threading layer (workqueue) does not survive.
    """
    num_rows, in_features = x.shape
    for n in numba.prange(weight.shape[0]):
        for m in range(num_rows):
            total = np.float32(0.0)
            for i in range(in_features):
                total += x[m, i] * weight[n, i]
            out[m, n] = total + bias[n] if bias.shape[0] else total


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


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not _inference_fp32_cpu(x):
        return torch.nn.functional.linear(x, self.weight, self.bias)  # the op has no autograd
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")


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
    out = x.new_empty(rows, self.out_features)
    bias = self.bias.detach().numpy() if self.bias is not None else _NO_BIAS
    _small_batch_linear(x.reshape(rows, -1).contiguous().numpy(), self.weight.detach().numpy(), bias, out.numpy())
    return out.view(*x.shape[:-1], self.out_features)


_NO_BIAS = np.empty(0, dtype=np.float32)
_FORWARDS: dict[str, Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]] = {
    "numba": _numba_forward,
    "onednn": _onednn_forward,
    "torch": _torch_forward,
    "torch_t": _torch_transposed_forward,
}


@dataclass(frozen=True)
class BackendPlan:
    """The route "auto" runs a linear through, by its number of input rows."""

    rows: tuple[int, ...]  # ascending row counts that were measured
    backends: tuple[str, ...]  # the fastest route measured at each

    def backend_for(self, rows: int) -> str:
        """The route measured at the smallest row count >= `rows`; "torch" past the last one."""
        index = bisect.bisect_left(self.rows, rows)
        return self.backends[index] if index < len(self.rows) else "torch"

    def describe(self) -> str:
        """E.g. "rows 1-3: torch, 4: numba, 5-32: onednn, more: torch"."""
        spans, first = [], 1
        for index, (rows, backend) in enumerate(zip(self.rows, self.backends)):
            if index + 1 < len(self.rows) and self.backends[index + 1] == backend:
                continue
            spans.append(f"{first}{'' if first == rows else f'-{rows}'}: {backend}")
            first = rows + 1
        return "rows " + ", ".join(spans) + ", more: torch"


# pass timer: (route, rows, linears) -> seconds for one forward of every linear with `rows` input rows
PassTimer = Callable[[str, int, Sequence[torch.nn.Linear]], float]
_PLANS: dict[tuple, BackendPlan] = {}  # per sample of linears' shapes and thread count, once per process


def _time_pass(backend: str, rows: int, linears: Sequence[torch.nn.Linear]) -> float:
    inputs = {n: torch.randn(1, rows, n) for n in {linear.in_features for linear in linears}}
    forward = _FORWARDS[backend]
    started = time.perf_counter()
    for linear in linears:
        forward(linear, inputs[linear.in_features])
    return time.perf_counter() - started


def plan_backends(
    linears: Sequence[torch.nn.Linear], rows: Sequence[int] = PLAN_ROWS, time_pass: PassTimer = _time_pass,
    repeats: int = PLAN_REPEATS,
) -> BackendPlan:
    """Time torch's BLAS (as x @ weight.T and as weight @ x.T), oneDNN (where torch has it) and
    the numba kernel (up to `SMALL_BATCH_ROWS` rows) over passes through `linears` at each row
    count; the fastest of `repeats` passes, taken in a rotating order so that drift hits every
    route alike, picks the route for that count. The fastest pass, not the median: on a shared
    machine a disturbance only ever adds time. With the median, a benchmark process on a 2-core
    AVX2 EPYC planned torch_t for 2 rows, where whole SmolLM2 forwards take 64 ms against numba's 53
    (its head-alone k=1 verify steps then took 79 ms, against 59 in a process that planned numba).
    """
    routes = ["torch", "torch_t", *(["onednn"] if onednn_available() else []), "numba"]
    with torch.no_grad():
        for route in routes:  # first calls pay one-time costs (numba loading its compiled kernel)
            time_pass(route, 1, linears)
        chosen = []
        for count in rows:
            candidates = [r for r in routes if r != "numba" or count <= SMALL_BATCH_ROWS]
            seconds: dict[str, list[float]] = {route: [] for route in candidates}
            for repeat in range(repeats):
                shift = repeat % len(candidates)
                for route in candidates[shift:] + candidates[:shift]:
                    seconds[route].append(time_pass(route, count, linears))
            chosen.append(min(candidates, key=lambda route: min(seconds[route])))
    return BackendPlan(rows=tuple(rows), backends=tuple(chosen))


def _plan_for(linears: Sequence[torch.nn.Linear]) -> BackendPlan:
    """The plan for these linears, measured on the first `PLAN_BYTES` of them, once per process."""
    sample, size = [], 0
    for linear in linears:
        if sample and size >= PLAN_BYTES:
            break
        sample.append(linear)
        size += linear.weight.numel() * linear.weight.element_size()
    key = (tuple((m.out_features, m.in_features, m.bias is not None) for m in sample), torch.get_num_threads())
    if key not in _PLANS:
        _PLANS[key] = plan_backends(sample)
    return _PLANS[key]


def linear_plan(*modules: torch.nn.Module) -> BackendPlan | None:
    """The plan `fast_cpu_linears(*modules)` ("auto") runs their fp32 CPU linears by (measured on
    first use); None when they have none."""
    linears = list(_fp32_cpu_linears(modules))
    if not linears:
        return None
    with _numba_threads_like_torch():
        return _plan_for(linears)


@contextlib.contextmanager
def _numba_threads_like_torch() -> Iterator[None]:
    """numba's kernel threads follow `torch.get_num_threads()` inside the block."""
    numba_threads = numba.get_num_threads()
    try:
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        yield
    finally:
        numba.set_num_threads(numba_threads)


def _planned_forward(self: torch.nn.Linear, routes: tuple, x: torch.Tensor) -> torch.Tensor:
    """`routes[rows]`: the plan's forward for that many rows (`_route_table`); torch's past its end.
    Runs for every linear of every forward, so it checks as little as it can (a few µs matter here)."""
    rows = x.numel() // self.in_features
    if rows < len(routes) and x.dtype is torch.float32 and x.is_cpu and not torch.is_grad_enabled():
        return routes[rows](self, x)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def _route_table(plan: BackendPlan) -> tuple:
    return tuple(_FORWARDS[plan.backend_for(rows)] for rows in range(plan.rows[-1] + 1))


def resolve_backend(backend: str, modules: Iterable[torch.nn.Module]) -> str:
    """The backend the loop runs, "auto", "numba", "onednn" or "torch", for the configured `backend`.

    "auto" stays "auto" (measured routes) when `modules` hold some fp32 CPU linear, else it is
    "torch"; "onednn" where torch has no oneDNN raises, naming the allowed values.
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
    return "auto" if next(_fp32_cpu_linears(modules), None) is not None else "torch"


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
    patched = list(_fp32_cpu_linears(modules))
    with _numba_threads_like_torch():
        try:
            routes = _route_table(_plan_for(patched)) if backend == "auto" and patched else None
            for linear in patched:
                if routes is None:
                    linear.forward = types.MethodType(_FORWARDS[backend], linear)
                else:
                    linear.forward = functools.partial(_planned_forward, linear, routes)
            yield
        finally:
            for linear in patched:
                linear.__dict__.pop("forward", None)
