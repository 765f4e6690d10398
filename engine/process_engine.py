"""ProcessEngine: the engine core in its own process, behind the server's interface.

The API process (this one) keeps HTTP, validation, tokenisation, detokenisation,
stop strings and streaming; the child (engine/core_process.py, multiprocessing
spawn) runs the scheduler and the runner and never waits on Python code of the
front end. They talk over two pipes, one batched message per round each way
(engine/ipc.py): requests added and aborted in one turn of the event loop go in
one message; each step comes back as one message with every request's new tokens.

A reader thread here receives the steps and hands each to `CoreClient`
(engine/core_client.py, the front end `DataParallelEngine`'s replicas share), which
detokenises them, asks the engine to stop requests a stop string ended, and hands
each event loop its deltas in one call per step.

When the engine process dies (SIGKILL, out of memory, a fault it cannot recover
from), the reader sees its pipe close: every open request ends at once with
`EngineProcessDiedError` (503; a stream gets an error event, then `[DONE]`),
`/health` answers 503 with the reason, and a new engine process is started unless
`restart=False`, in which case the `on_death` callbacks run (the CLI exits non-zero,
for supervisors). A process that dies before it is ready is not restarted again.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.core_client import CoreClient
from engine.core_process import engine_main
from engine.errors import EngineDeadError, EngineProcessDiedError
from engine.ipc import Codec, EngineInputs, Failed, Ready, StepOutputs
from engine.output import RequestDelta
from engine.tokenizer import Tokenizer
from runner.model_prep import resolve_model
from scheduler import SamplingParams

logger = logging.getLogger("specbudget.engine")


class EngineState:
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass
class _Child:
    """One engine process and the API process's ends of its pipes."""

    process: BaseProcess
    to_engine: Connection
    from_engine: Connection
    started: float
    ready: threading.Event
    failed: Failed | None = None  # its last word, if it sent one


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ProcessEngine:
    """`ServingEngine` over an engine-core child process; see the module docstring."""

    def __init__(self, config: EngineConfig, log_interval_s: float = 10.0,
                 restart: bool = True, start_timeout_s: float = 600.0,
                 log_level: int = logging.INFO) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_dir(resolve_model(config.model))
        self.client = CoreClient(config, self.tokenizer, self._send_bytes, self._gate,
                                 log_interval_s)
        self.on_step = self.client.on_step  # the metrics hooks, run per step
        self.restart = restart
        self.start_timeout_s = start_timeout_s
        self.log_level = log_level
        self.on_death: list[Callable[[str], None]] = []
        self.state = EngineState.STARTING
        self.error: str | None = None
        self.pid: int | None = None
        self.num_restarts = 0
        self.last_start_s: float | None = None  # spawn to ready, last (re)start
        self._codec = Codec()
        self._ctx = multiprocessing.get_context("spawn")
        self._send_lock = threading.Lock()
        self._closing = False
        self._child = self._spawn()
        self._wait_first_start(self._child)

    # ---- the child's lifetime ----------------------------------------------------

    def _spawn(self) -> _Child:
        from_engine, child_out = self._ctx.Pipe(duplex=False)
        child_in, to_engine = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(target=engine_main, name="specbudget-engine-core",
                                    args=(self.config, child_in, child_out, self.log_level),
                                    daemon=True)
        process.start()
        # Only the child may hold its ends: its death must close our reading end.
        child_out.close()
        child_in.close()
        child = _Child(process, to_engine, from_engine, time.monotonic(), threading.Event())
        threading.Thread(target=self._read, args=(child,), daemon=True,
                         name="specbudget-engine-reader").start()
        return child

    def _wait_first_start(self, child: _Child) -> None:
        if not child.ready.wait(self.start_timeout_s):
            self.shutdown()
            raise TimeoutError(f"the engine process did not start within "
                               f"{self.start_timeout_s:g} s")
        if self.state != EngineState.READY:
            self.shutdown()
            if child.failed is not None and child.failed.kind == "ValueError":
                raise ValueError(child.failed.message)  # settings the engine refused
            raise RuntimeError(f"the engine process failed to start: {self.error}")

    def _read(self, child: _Child) -> None:
        """The reader thread of one child: until its pipe closes."""
        try:
            while True:
                message = self._codec.decode_outputs(child.from_engine.recv_bytes())
                if isinstance(message, StepOutputs):
                    self.client.on_outputs(message)
                elif isinstance(message, Ready):
                    self._on_ready(child, message)
                elif isinstance(message, Failed):
                    child.failed = message
        except (EOFError, OSError):
            pass
        except Exception:  # a fault on this side: the process is useless without us
            logger.exception("failed handling the engine process's output; stopping it")
            child.failed = Failed("RuntimeError", "the API process failed handling its output")
            child.process.kill()
        self._on_exit(child)

    def _on_ready(self, child: _Child, message: Ready) -> None:
        self.pid = message.pid
        self.last_start_s = time.monotonic() - child.started
        self.error = None
        self.state = EngineState.READY
        logger.info("engine process %d ready in %.1f s (%s)", message.pid,
                    self.last_start_s, message.description)
        child.ready.set()

    def _on_exit(self, child: _Child) -> None:
        child.process.join(timeout=1.0)  # its pipe closed: it is gone or going
        child.to_engine.close()
        if self._closing:
            self.state = EngineState.STOPPED
            child.ready.set()
            return
        was_ready = child.ready.is_set()
        reason = (f"engine process {child.process.pid} {describe_exit(child.process.exitcode)}"
                  + (f": {child.failed.error}" if child.failed else ""))
        logger.error("%s; failing every request in flight", reason)
        self.error = reason
        self.state = EngineState.DEAD
        self.client.fail_streams(EngineProcessDiedError(reason))
        if was_ready and self.restart:
            self.num_restarts += 1
            self.state = EngineState.RESTARTING
            logger.warning("restarting the engine process (restart %d)", self.num_restarts)
            self._child = self._spawn()
            return
        child.ready.set()  # a first start that failed: the constructor raises
        if was_ready:
            for callback in self.on_death:
                callback(reason)

    # ---- requests going in ---------------------------------------------------------

    def _send_bytes(self, data: bytes) -> None:
        with self._send_lock:
            try:
                self._child.to_engine.send_bytes(data)
            except OSError:  # the engine process is gone: the reader fails its requests
                logger.debug("engine process gone; message dropped")

    def _gate(self) -> None:
        if self.state != EngineState.READY:
            raise (EngineProcessDiedError if self.error else EngineDeadError)(
                f"the engine is not serving ({self.state}): {self.error}")

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, priority: int = 0,
                 buffered: bool = False) -> AsyncIterator[RequestDelta]:
        """Stream one request's deltas; leaving early (a disconnect) aborts it."""
        return self.client.generate(request_id, prompt_token_ids, params, priority)

    def abort(self, request_id: str) -> None:
        self.client.abort(request_id)

    def fail_all(self, error: BaseException) -> int:
        """End every request in flight with `error` and abort it in the engine."""
        return self.client.fail_all(error)

    # ---- what the server asks -------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self.state == EngineState.READY

    def load(self) -> tuple[int, int]:
        """(waiting, running) as of the engine's last step."""
        return self.client.load()

    def health(self) -> tuple[bool, dict[str, Any]]:
        details: dict[str, Any] = {"engine_state": self.state, "engine_pid": self.pid,
                                   "engine_restarts": self.num_restarts,
                                   "engine_start_s": (None if self.last_start_s is None
                                                      else round(self.last_start_s, 2))}
        if self.error is not None:
            details["error"] = self.error
        return self.is_alive, details

    def export_metrics(self, registry: CollectorRegistry,
                       model_name: str) -> Callable[[], None]:
        """Export the engine's `specbudget:*` metrics on `registry`, fed from the engine
        process's step messages; returns the undo."""
        from engine.metrics import wire_step_metrics

        return wire_step_metrics(self.on_step, registry, model_name)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine process to stop; kill it if it has not within `timeout`."""
        self._closing = True
        child = self._child
        self.client.send(EngineInputs(shutdown=True))
        child.process.join(timeout)
        if child.process.is_alive():  # it ignores SIGTERM (engine/core_process.py)
            child.process.kill()
            child.process.join(2.0)
        self.state = EngineState.STOPPED

