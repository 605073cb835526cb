"""fp32 `nn.Linear` on CPU through oneDNN instead of torch's default BLAS call.

Why: torch runs an fp32 CPU linear as an MKL sgemm. On the AMD EPYC machines we measure on, MKL
takes about 2x longer for 2..9 input rows than for one (SmolLM2's 49k-row lm_head: 9.9 ms for 1
row, 23 ms for 2 or 6), so a whole verify forward over k+1 tokens cost 1.5-1.8x a one-token
decode step and ate most of what accepted drafts save. oneDNN, which torch ships and already
uses for bf16, runs the same shapes at 4.5 / 5.8 / 7.6 ms (SmolLM2 forward: 44 ms for 1 token,
63 ms for 6, against MKL's 57 and 82-100 ms). torch has no public switch that sends fp32 linears
to oneDNN without lowering their precision, so we call its `mkldnn._linear_pointwise` op on the
module's own weight (no copy, no prepacking: same memory) while the context is active. Results
are fp32 GEMMs like MKL's, differing only in rounding (a few 1e-6 relative).

`onednn_linears` is public: it speeds up plain `generate()` on CPU too, and the benchmark uses it
to report how much of a speedup is speculation and how much is the GEMM.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterable, Iterator

import torch

from .config import CPU_LINEAR_BACKENDS


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


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        return torch.nn.functional.linear(x, self.weight, self.bias)  # the op has no autograd
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")


def resolve_backend(backend: str, modules: Iterable[torch.nn.Module]) -> str:
    """The backend the loop runs, "onednn" or "torch", for the configured `backend`.

    "auto" is oneDNN when this torch has it and `modules` hold some fp32 CPU linear; "onednn"
    where torch has no oneDNN raises, naming the allowed values.
    """
    if backend not in CPU_LINEAR_BACKENDS:
        raise ValueError(f"cpu_linear_backend={backend!r} is unknown; allowed: {', '.join(CPU_LINEAR_BACKENDS)}")
    if backend == "torch":
        return "torch"
    if not onednn_available():
        if backend == "onednn":
            raise ValueError(
                "cpu_linear_backend='onednn' but this torch build has no working oneDNN linear; "
                "allowed here: 'auto' or 'torch'"
            )
        return "torch"
    return "onednn" if next(_fp32_cpu_linears(modules), None) is not None else "torch"


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
def onednn_linears(*modules: torch.nn.Module) -> Iterator[None]:
    """Inside the block, every fp32 CPU `nn.Linear` of `modules` runs through oneDNN (inference
    only: with grad enabled they fall back to `F.linear`). Does nothing where oneDNN is missing.

    >>> with torch.no_grad(), onednn_linears(model):
    ...     model.generate(**inputs)
    """
    patched = list(_fp32_cpu_linears(modules)) if onednn_available() else []
    try:
        for linear in patched:
            linear.forward = types.MethodType(_onednn_forward, linear)
        yield
    finally:
        for linear in patched:
            del linear.forward
