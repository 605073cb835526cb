"""Where a speculative step's time goes: `with profile_steps() as profile: model.generate(...)`.

Each step times its parts with a `StepTimer` (always: the loop's metrics come from it), and every
network forward runs inside `timed_forward()`. While a profile is active a step splits into:

- `draft_forward` (the drafter's networks: draft model, EAGLE head, MTP layers, early exit) and
  `draft_other` (the rest of drafting: lookups, cache prepare / rollback, feature queues, copies);
- `verify_forward` (the target's forward) and `verify_other` (packing every row's tokens and
  positions, the host-to-device copy, block tables);
- `logits_processing` (the request's processors at every verify position) and `sampling` (random
  draws, rejection sampling or tree acceptance);
- `emit` (the device-to-host read, appending tokens, stop checks, cache rollback, releasing rows);
- `glue`: from the end of one step to the start of the next (the caller's handling of the tokens).

Only decode steps count: a step that feeds a prompt is left out, as plain decoding's time per token
leaves out the prompt's forward. With no profile active, only the laps' clock reads remain. On CUDA
a profile synchronises the device at every boundary (kernels run asynchronously), which slows the
run a little: profile apart from the runs you time there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

import torch

SECTIONS = (
    "draft_forward", "draft_other", "verify_forward", "verify_other", "logits_processing", "sampling", "emit", "glue",
)  # fmt: skip
_LAPS = ("draft", "verify", "logits_processing", "sampling", "emit")


class StepProfile:
    """Seconds per section (`SECTIONS`), summed over the decode steps profiled (`num_steps`)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(SECTIONS, 0.0)
        self.num_steps = 0
        self.forward_seconds = 0.0  # forwards since the current step's last lap
        self._last_counted_end: float | None = None  # end of the previous step, when it counted

    def merge(self, other: StepProfile) -> None:
        for part, value in other.seconds.items():
            self.seconds[part] += value
        self.num_steps += other.num_steps

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per decode step for each section, and their sum as "total"."""
        if not self.num_steps:
            return {}
        out = {part: 1000 * value / self.num_steps for part, value in self.seconds.items()}
        out["total"] = sum(out.values())
        return out

    @contextlib.contextmanager
    def _forward(self, device: torch.device) -> Iterator[None]:
        started = _now(device, True)
        try:
            yield
        finally:
            self.forward_seconds += _now(device, True) - started

    def _record(self, started: float, ended: float, laps: dict[str, float], forwards: dict[str, float], counted: bool):
        if self._last_counted_end is not None:  # the gap since the previous counted step is its glue
            self.seconds["glue"] += started - self._last_counted_end
        self._last_counted_end = ended if counted else None
        if not counted:
            return
        self.num_steps += 1
        for part in ("draft", "verify"):
            self.seconds[f"{part}_forward"] += forwards[part]
            self.seconds[f"{part}_other"] += laps[part] - forwards[part]
        for part in ("logits_processing", "sampling", "emit"):
            self.seconds[part] += laps[part]


_active: ContextVar[StepProfile | None] = ContextVar("hf_specdec_step_profile", default=None)


@contextlib.contextmanager
def profile_steps() -> Iterator[StepProfile]:
    """Profiles every speculative step run inside the block (in this thread / context)."""
    profile = StepProfile()
    token = _active.set(profile)
    try:
        yield profile
    finally:
        _active.reset(token)


def timed_forward(device: torch.device) -> contextlib.AbstractContextManager:
    """Wraps a network forward on `device`: the current part's forward time when profiling."""
    profile = _active.get()
    return contextlib.nullcontext() if profile is None else profile._forward(device)


class StepTimer:
    """The clock of one step: `lap(part)` returns the seconds since the previous lap (or the start)
    and, when profiling, records them; `finish(fed_prompt)` ends the step."""

    def __init__(self, device: torch.device):
        self.profile = _active.get()
        self.device = device
        self.started = self._last = _now(device, self.profile is not None)
        self.laps = dict.fromkeys(_LAPS, 0.0)
        self.forwards = dict.fromkeys(_LAPS, 0.0)
        if self.profile is not None:
            self.profile.forward_seconds = 0.0

    def lap(self, part: str) -> float:
        now = _now(self.device, self.profile is not None)
        elapsed, self._last = now - self._last, now
        self.laps[part] += elapsed
        if self.profile is not None:
            self.forwards[part] += self.profile.forward_seconds
            self.profile.forward_seconds = 0.0
        return elapsed

    def elapsed(self) -> float:
        return _now(self.device, self.profile is not None) - self.started

    def finish(self, fed_prompt: bool) -> None:
        if self.profile is not None:
            self.profile._record(self.started, self._last, self.laps, self.forwards, counted=not fed_prompt)


def _now(device: torch.device, sync: bool) -> float:
    if sync and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
