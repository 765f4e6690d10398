"""CoreClient: the API process's side of one engine core, whatever carries the bytes.

`ProcessEngine` (one engine core in a child process, pipes) and `DataParallelEngine`
(N engine cores in Ray actors) both front their cores with this class, so the two
share one message format (engine/ipc.py) and one front end: requests added and
aborted in one turn of the event loop go as one `EngineInputs`; each `StepOutputs`
that comes back is detokenised here (`OutputProcessor`), stop strings found here are
sent back as stops, and every event loop waiting on the step gets its deltas in one
call. The owner calls `on_outputs` from the thread that receives the engine's
messages, and `fail_streams` when the core is gone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.config import EngineConfig
from engine.errors import RequestFailedError
from engine.ipc import Codec, EngineInputs, NewRequest, Snapshot, StepOutputs
from engine.output import LatencySample, OutputProcessor, RequestDelta
from engine.serving import DeltaStream, queued_deltas
from engine.tokenizer import Tokenizer
from scheduler import SamplingParams
from scheduler.stats import SchedulerStats

logger = logging.getLogger("specbudget.engine")

StepHook = Callable[[Any, list[RequestDelta], dict[str, LatencySample]], None]


class SnapshotView:
    """The engine's last `Snapshot` as the metrics hook reads an EngineCore."""

    def __init__(self, config: EngineConfig, snapshot: Snapshot) -> None:
        self.config = config
        self.scheduler = self
        self.runner = self
        self.stats: SchedulerStats = snapshot.stats
        self.running = range(snapshot.running)
        self.waiting = range(snapshot.waiting)
        self.last_pass_rows = snapshot.pass_rows
        self._kv_usage = snapshot.kv_usage

    def kv_cache_usage(self) -> float:
        return self._kv_usage


class CoreClient:
    """See the module docstring. `send` carries one encoded `EngineInputs` to the core
    (it must not raise when the core is gone: the owner fails the requests then);
    `gate` raises when the core does not take requests."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer,
                 send: Callable[[bytes], None], gate: Callable[[], None],
                 log_interval_s: float = 10.0, name: str = "engine") -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)
        self.on_step: list[StepHook] = []
        self.snapshot = Snapshot(0, 0, 0.0, {}, SchedulerStats())
        self.name = name
        self.log_interval_s = log_interval_s
        self._send_bytes = send
        self._gate = gate
        self._codec = Codec()
        self._lock = threading.Lock()  # streams, processor, pending inputs
        self._hook_lock = threading.Lock()
        self._streams: dict[str, DeltaStream] = {}
        self._adds: list[NewRequest] = []
        self._aborts: list[str] = []
        self._flush_scheduled = False
        self._last_log = time.monotonic()

    @property
    def num_open(self) -> int:
        """Requests sent to this core that have not ended."""
        return len(self._streams)

    # ---- steps coming back ---------------------------------------------------------

    def on_outputs(self, message: StepOutputs) -> None:
        """One step's message: detokenise, run the metrics hooks, hand each event loop
        its deltas, send the stops that stop strings asked for."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[DeltaStream, Any]]] = {}
        with self._lock:
            deltas, stopped, latency = self.processor.process(message.outputs)
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is None:
                    continue
                failed = delta.error is not None
                item = RequestFailedError(delta.error) if failed else delta
                batches.setdefault(stream.loop, []).append((stream, item))
                if delta.finished:
                    del self._streams[delta.request_id]
            for request_id, why in message.refused:
                self.processor.drop(request_id)
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream, ValueError(why)))
        # The metrics count a step before any caller sees it, so a client that has its
        # answer reads it in /metrics (AsyncEngine keeps the same order).
        self.snapshot = message.snapshot
        self.run_hooks(deltas, latency)
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)
        if stopped:
            self.send(EngineInputs(stops=stopped))
        if time.monotonic() - self._last_log >= self.log_interval_s:
            self._log_line()

    def fail_streams(self, error: BaseException) -> int:
        """End every open request with `error` (the core is gone, or the server stops)."""
        with self._lock:
            streams, self._streams = self._streams, {}
            for request_id in streams:
                self.processor.drop(request_id)
            self._adds.clear()
        for stream in streams.values():
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        return len(streams)

    def run_hooks(self, deltas: list[RequestDelta],
                  latency: dict[str, LatencySample]) -> None:
        if self.on_step:
            view = SnapshotView(self.config, self.snapshot)
            with self._hook_lock:  # the receiving thread, and an abort on the event loop
                for hook in self.on_step:
                    hook(view, deltas, latency)

    def _log_line(self) -> None:
        self._last_log = time.monotonic()
        snap = self.snapshot
        rate = snap.stats.spec.acceptance_rate
        accept = f", acceptance {rate:.2f}" if rate is not None else ""
        logger.info("%s: running %d, waiting %d, KV usage %.1f%%%s", self.name, snap.running,
                    snap.waiting, 100 * snap.kv_usage, accept)

    # ---- requests going in ---------------------------------------------------------

    def send(self, message: EngineInputs) -> None:
        self._send_bytes(self._codec.encode(message))

    def _flush(self) -> None:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            self._flush_scheduled = False
        if adds or aborts:
            self.send(EngineInputs(adds=adds, aborts=aborts))

    def _request_flush(self) -> None:
        """Send what this turn of the event loop queued in one message, at its end
        (outside an event loop: now)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._flush()
            return
        with self._lock:
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        loop.call_soon(self._flush)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0) -> AsyncIterator[RequestDelta]:
        """Stream one request's deltas; leaving early (a disconnect) aborts it."""
        stream = DeltaStream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._gate()
            self._streams[request_id] = stream
            self.processor.add(request_id, len(prompt_token_ids), params)
            self._adds.append(NewRequest(request_id, prompt_token_ids, params,
                                         self.tokenizer.eos_token_id, priority))
        self._request_flush()
        async for delta in queued_deltas(stream.queue, lambda: self.abort(request_id)):
            yield delta

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._streams.pop(request_id, None) is None:
                return
            delta = self.processor.abort(request_id)
            self._aborts.append(request_id)
        self._request_flush()
        if delta is not None:  # metrics count aborts as finished requests, like vLLM
            self.run_hooks([delta], {})

    def fail_all(self, error: BaseException) -> int:
        """End every open request with `error` and abort it in the core."""
        with self._lock:
            ids = list(self._streams)
        count = self.fail_streams(error)
        if ids:
            self.send(EngineInputs(aborts=ids))
        return count

    def load(self) -> tuple[int, int]:
        """(waiting, running) as of the core's last step, counting requests sent since."""
        running = min(self.snapshot.running, self.num_open)
        return max(self.snapshot.waiting, self.num_open - running), running


def _put_all(items: list[tuple[DeltaStream, Any]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
