"""AsyncEngine: the engine core on a background thread, streams to asyncio callers.

The thread is a busy loop that sleeps when idle: it applies queued adds and aborts,
runs one step, and hands each request's delta to that request's asyncio queue. A
fault inside a step kills the engine cleanly: every request in flight gets an
`EngineDeadError`, `is_alive` turns False (the server's /health answers 503), and new
requests are refused at once instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import (
    EngineDeadError,
    RequestFailedError,
)
from engine.output import LatencySample, OutputProcessor, RequestDelta
from engine.serving import DeltaStream, queued_deltas
from engine.tokenizer import Tokenizer
from runner.models.llama import LlamaForCausalLM
from scheduler import Request, SamplingParams

logger = logging.getLogger("specbudget.engine")


StatsHook = Callable[[EngineCore, list[RequestDelta], dict[str, LatencySample]], None]


class AsyncEngine:
    """Thread-safe front of EngineCore for servers; see the module docstring."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM | None = None,
                 log_interval_s: float = 10.0) -> None:
        self.core = EngineCore(config, model=model)
        self.tokenizer = Tokenizer.from_dir(self.core.runner.model_path)
        self.processor = OutputProcessor(self.tokenizer)
        self.config = config
        self.log_interval_s = log_interval_s
        self.on_step: list[StatsHook] = []
        self._streams: dict[str, DeltaStream] = {}
        self._adds: list[tuple[Request, SamplingParams]] = []
        self._aborts: list[str] = []
        self._wake = threading.Condition()
        self._stop = False
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specbudget-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    def load(self) -> tuple[int, int]:
        """(waiting, running): queue lengths for a data-parallel router; requests
        handed over but not yet picked up by the engine thread count as waiting."""
        sched = self.core.scheduler
        return len(sched.waiting) + len(self._adds), len(sched.running)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(serving, details) for /health."""
        return self.is_alive, {} if self.dead is None else {"error": repr(self.dead)}

    def export_metrics(self, registry: CollectorRegistry,
                       model_name: str) -> Callable[[], None]:
        """Export the engine's `specbudget:*` metrics on `registry`; returns the undo."""
        from engine.metrics import wire_step_metrics

        return wire_step_metrics(self.on_step, registry, model_name)

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0,
                       buffered: bool = False) -> AsyncIterator[RequestDelta]:
        """Stream one request's deltas; leaving early (a disconnect) aborts it.
        (`buffered` changes nothing here: this engine cannot lose a request midway.)"""
        if not self.is_alive:
            raise EngineDeadError(f"engine is dead: {self.dead!r}")
        stream = DeltaStream(asyncio.get_running_loop(), asyncio.Queue())
        request = Request(request_id, prompt_token_ids, params,
                          eos_token_id=self.tokenizer.eos_token_id, priority=priority)
        with self._wake:
            self._streams[request_id] = stream
            self._adds.append((request, params))
            self._wake.notify()
        async for delta in queued_deltas(stream.queue, lambda: self.abort(request_id)):
            yield delta

    def fail_all(self, error: BaseException) -> int:
        """End every request in flight with `error` and abort it in the engine (a
        shutdown that stops waiting); returns how many there were."""
        with self._wake:
            streams, self._streams = self._streams, {}
            self._aborts.extend(streams)
            self._wake.notify()
        for stream in streams.values():
            self._deliver_to(stream, error)
        return len(streams)

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._streams.pop(request_id, None)
            self._aborts.append(request_id)
            self._wake.notify()

    # ---- the engine thread ------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestDelta | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _apply_inputs(self) -> None:
        with self._wake:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        aborted = []
        for request_id in aborts:
            self.core.abort_request(request_id)
            delta = self.processor.abort(request_id)
            if delta is not None:
                aborted.append(delta)
        for request, params in adds:
            if request.request_id not in self._streams:
                # Its client left before the engine picked it up: an abort all the same.
                aborted.append(RequestDelta(request.request_id, [], "", True, "abort",
                                            request.num_prompt_tokens, 0))
                continue
            try:
                self.core.add_request(request)
                self.processor.add(request.request_id, request.num_prompt_tokens, params)
            except ValueError as err:
                with self._wake:
                    self._deliver(request.request_id, err)
                    self._streams.pop(request.request_id, None)
        if aborted:  # metrics count aborts as finished requests, like vLLM
            for hook in self.on_step:
                hook(self.core, aborted, {})

    def _run(self) -> None:
        last_log = time.monotonic()
        try:
            while True:
                with self._wake:
                    while not (self._stop or self._adds or self._aborts
                               or self.core.has_unfinished_requests()):
                        self._wake.wait(timeout=1.0)  # idle: sleep until work arrives
                    if self._stop:
                        return
                self._apply_inputs()
                if self.core.has_unfinished_requests():
                    self._step()
                if time.monotonic() - last_log >= self.log_interval_s:
                    self._log_line()
                    last_log = time.monotonic()
        except BaseException as err:
            logger.exception("engine step failed; failing every request in flight")
            self.dead = err
            with self._wake:
                streams, self._streams = self._streams, {}
            for request_id in streams:
                self._deliver_to(streams[request_id],
                                 EngineDeadError(f"engine step failed: {err!r}"))

    @staticmethod
    def _deliver_to(stream: DeltaStream, item: BaseException) -> None:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _step(self) -> None:
        updates = self.core.step()
        deltas, stopped, latency = self.processor.process(updates)
        for request_id in stopped:
            self.core.stop_request(request_id)
        for hook in self.on_step:
            hook(self.core, deltas, latency)
        with self._wake:
            for delta in deltas:
                failed = delta.error is not None
                self._deliver(delta.request_id,
                              RequestFailedError(delta.error) if failed else delta)
                if delta.finished:
                    self._streams.pop(delta.request_id, None)

    def _log_line(self) -> None:
        sched = self.core.scheduler
        spec = sched.stats.spec
        accept = (f", acceptance {spec.acceptance_rate:.2f}"
                  if spec.acceptance_rate is not None else "")
        logger.info("running %d, waiting %d, KV usage %.1f%%%s", len(sched.running),
                    len(sched.waiting), 100 * sched.kv_cache_usage(), accept)
