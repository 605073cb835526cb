"""Which positions of a forward's `[rows, width]` input hold tokens, where the rest is padding.

A batch on the model's own cache (`cache/own_attention.py`) pads each row's new tokens to the longest
row's; with n-gram drafts most rows feed one token a step, so a `[8, 5]` forward carries 8-15 tokens
in 40 positions. The fp32 CPU linears (`models/cpu_linear.py`) then compute only the token positions
(padding comes out as zeros, which nothing reads: the mask hides padding from every real query, and
the next realignment drops it). Set by `cache/forward.py` around such a forward; None elsewhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

# ((rows, width), flat indices of the token positions) of the forward running now
_TOKEN_POSITIONS: ContextVar[tuple[tuple[int, int], torch.Tensor] | None] = ContextVar("token_positions", default=None)


@contextlib.contextmanager
def tokens_at(shape: tuple[int, int], positions: torch.Tensor) -> Iterator[None]:
    """Inside the block the forward's `[rows, width]` inputs hold tokens at `positions` (flat) only. Where every
    position holds one (each row as many new tokens: a step without drafts), nothing changes."""
    if len(positions) == shape[0] * shape[1]:
        yield
        return
    token = _TOKEN_POSITIONS.set((shape, positions))
    try:
        yield
    finally:
        _TOKEN_POSITIONS.reset(token)


def token_positions(x: torch.Tensor) -> torch.Tensor | None:
    """The flat token positions of `x` when it is laid out `[rows, width, features]` as the running forward's
    inputs; None otherwise (or where rows == width, which a `[width, rows]` layout could not be told from)."""
    current = _TOKEN_POSITIONS.get()
    if current is None or x.dim() != 3:
        return None
    shape, positions = current
    if tuple(x.shape[:2]) != shape or shape[0] == shape[1]:
        return None
    return positions
