"""One thread drives the `SpeculativeEngine`; HTTP handlers talk to it through queues.

The engine is not thread-safe, so nothing but this thread calls it. `hf-specdec serve` runs it on
the main thread (`run`) and uvicorn on another: torch's OpenMP threads serve best the thread that
ran the process's first parallel region (loading the model did), and a second thread's team
competes with the first's (SmolLM2 on 2 cores: plain generate() 71 ms per token on a second thread,
44 on the main one). `start` runs it on a thread of its own instead (the tests). Handlers put commands (add a
request, abort one) on a thread-safe queue; the thread drains the queue before each
`engine.step()` and hands each request's outputs to that request's asyncio queue with
`loop.call_soon_threadsafe(queue.put_nowait, ...)`. With nothing to run it blocks on the command
queue (no busy spin). After every round it publishes a snapshot of the engine's counters for
/metrics, again so that handlers never read the engine while the thread changes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class EngineError:
    """Sent instead of an output when the engine refused a request (status 400: `add_request` raised
    ValueError), failed outside a step's own error handling (500), or the server stops (503)."""

    message: str
    status_code: int


@dataclass
class EngineStats:
    """The engine's counters after the latest round: `metrics` is `engine.metrics.to_dict()`."""

    metrics: dict
    num_running: int
    num_waiting: int


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    generation_config: Any
    event_loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    options: dict  # add_request's keyword arguments: seed, logprobs, grammar, logits_processor


@dataclass
class _Abort:
    request_id: str


_STOP = object()
IDLE_WAKE_SECONDS = 0.5


class EngineLoop:
    """The engine's thread: `run()` (or `start()` for a thread of its own), then `add()` / `abort()` from
    the event loop, `stop()` at shutdown."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self.run, name="hf-specdec-engine", daemon=True)
        # request id -> (event loop, outputs queue); only the engine thread touches it
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.stats = self._snapshot()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends `run` after its current step (waits for it when `start` ran it); requests still open get a
        503 EngineError."""
        self._commands.put(_STOP)
        if self._thread.is_alive():
            self._thread.join()

    def end_all(self) -> None:
        """`run` was interrupted (Ctrl-C on the main thread): every open request gets a 503 EngineError."""
        self._end_all(EngineError("the server is shutting down", 503))

    def add(
        self, request_id: str, prompt_ids: list[int], generation_config: Any, outputs: asyncio.Queue | None = None,
        **options: Any,
    ) -> asyncio.Queue:
        """Queues the request (`options`: `SpeculativeEngine.add_request`'s keyword arguments); returns the
        asyncio queue its outputs (or an EngineError) arrive on: `outputs` when given (several requests may
        share one: each output names its request), else a new one. Call from the event loop's thread."""
        outputs = asyncio.Queue() if outputs is None else outputs
        self._commands.put(_Add(request_id, prompt_ids, generation_config, asyncio.get_running_loop(), outputs, options))
        return outputs

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def run(self) -> None:
        """Drive the engine in this thread until `stop()`."""
        while True:
            # idle: wait for a command (waking now and then: a Ctrl-C reaches a thread only between
            # Python calls, and an endless queue wait never returns); busy: take whatever is queued and step
            commands = []
            while not commands and not self.engine.has_unfinished():
                with contextlib.suppress(queue.Empty):
                    commands.append(self._commands.get(timeout=IDLE_WAKE_SECONDS))
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is _STOP:
                    self._end_all(EngineError("the server is shutting down", 503))
                    return
                self._apply(command)
            if self.engine.has_unfinished():
                self._step()
            self.stats = self._snapshot()

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort(command.request_id)  # False when it had already finished: nothing to do
            self._sinks.pop(command.request_id, None)
            return
        sink = (command.event_loop, command.outputs)
        try:
            self.engine.add_request(
                command.prompt_ids, command.generation_config, request_id=command.request_id, **command.options
            )
        except ValueError as error:  # the engine's own checks of the request: the client's error
            self._send(sink, EngineError(str(error), 400))
            return
        except Exception as error:  # a bug: this request fails, the thread goes on
            logger.exception("engine.add_request() raised")
            self._send(sink, EngineError(f"engine failure: {error!r}", 500))
            return
        self._sinks[command.request_id] = sink

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # the engine ends a failing step's requests itself; this is anything else
            logger.exception("engine.step() raised; ending every open request")
            for request_id in self._sinks:
                self.engine.abort(request_id)
            self._end_all(EngineError(f"engine failure: {error!r}", 500))
            return
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:  # aborted by its handler while the step ran
                continue
            if output.finished:
                del self._sinks[output.request_id]
            self._send(sink, output)

    def _end_all(self, error: EngineError) -> None:
        for sink in self._sinks.values():
            self._send(sink, error)
        self._sinks.clear()

    @staticmethod
    def _send(sink: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item: Any) -> None:
        event_loop, outputs = sink
        event_loop.call_soon_threadsafe(outputs.put_nowait, item)

    def _snapshot(self) -> EngineStats:
        return EngineStats(self.engine.metrics.to_dict(), self.engine.num_running, self.engine.num_waiting)
