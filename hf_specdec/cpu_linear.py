"""fp32 `nn.Linear` on CPU through a small-batch numba kernel or oneDNN instead of torch's BLAS call.

Why: torch runs an fp32 CPU linear as an MKL sgemm. On the AMD EPYC machines we measure on, MKL
takes about 2x longer for 2..9 input rows than for one (SmolLM2's 49k-row lm_head: 8.8 ms for 1
row, 20 ms for 2), so a verify forward over k+1 tokens cost 1.5-1.8x a one-token decode step and
ate most of what accepted drafts save. oneDNN, which torch ships, halves that but still pays
~2.5x for 2 rows (3.9 / 9.9 ms): its GEMM packs the weight on every call. A decode or verify
step is bound by reading the weights once, so the "numba" backend runs up to `SMALL_BATCH_ROWS`
rows with `_small_batch_linear`: each weight row is read once and dotted with every input row
while it sits in L1 (lm_head 3.2 / 4.2 / 5.4 ms for 1 / 2 / 4 rows; a SmolLM2 forward of 1, 2,
4 tokens 51 / 55 / 57 ms against MKL's 63 / 113 / 104). More rows (prefill, large batches) go to
oneDNN, which is faster there. torch has no public switch for either route without lowering fp32
precision, so while the context is active a module's `forward` calls them on the module's own
weight (no copy, same memory). Results are fp32 dot products like MKL's, differing only in
rounding (a few 1e-6 relative); the numba kernel computes a row the same way whatever the other
rows are.

`fast_cpu_linears` is public: it speeds up plain `generate()` on CPU too, and the benchmark uses it
to report how much of a speedup is speculation and how much is the GEMM.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterable, Iterator

import numba
import numpy as np
import torch

from .config import CPU_LINEAR_BACKENDS

# up to here the numba kernel beats oneDNN on SmolLM2's shapes (lm_head at 8 rows: 9.5 vs 13.2 ms;
# whole forwards of 9 / 12 / 16 tokens: 83 / 103 / 131 ms against oneDNN's 103 / 116 / 120)
SMALL_BATCH_ROWS = 12


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
}


def resolve_backend(backend: str, modules: Iterable[torch.nn.Module]) -> str:
    """The backend the loop runs, "numba", "onednn" or "torch", for the configured `backend`.

    "auto" is numba when `modules` hold some fp32 CPU linear, else "torch"; "onednn" where torch
    has no oneDNN raises, naming the allowed values.
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
    return "numba" if next(_fp32_cpu_linears(modules), None) is not None else "torch"


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


@contextlib.contextmanager
def fast_cpu_linears(*modules: torch.nn.Module, backend: str = "numba") -> Iterator[None]:
    """Inside the block, every fp32 CPU `nn.Linear` of `modules` runs through `backend`: "numba"
    (up to `SMALL_BATCH_ROWS` rows in our kernel, more through oneDNN) or "onednn" (an error where
    this torch has none). Inference only: with grad enabled they fall back to `F.linear`.
    numba's threads follow `torch.get_num_threads()` meanwhile.

    >>> with torch.no_grad(), fast_cpu_linears(model):
    ...     model.generate(**inputs)
    """
    if backend not in _FORWARDS:
        raise ValueError(f"backend={backend!r} is unknown; allowed: {', '.join(_FORWARDS)}")
    resolve_backend(backend, modules)  # raises where oneDNN is demanded but missing
    patched = list(_fp32_cpu_linears(modules))
    numba_threads = numba.get_num_threads()
    try:
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        for linear in patched:
            linear.forward = types.MethodType(_FORWARDS[backend], linear)
        yield
    finally:
        numba.set_num_threads(numba_threads)
        for linear in patched:
            del linear.forward
