"""The engine core's own process: scheduler and runner, nothing of HTTP.

`engine_main` is the child's entry point (multiprocessing spawn, started by
`ProcessEngine`, engine/process_engine.py). It loads the engine, says `Ready`, then
loops: take every message the API process sent (adds, aborts, stops, batched), run
one step, send one `StepOutputs`. Idle, it blocks on its input pipe.

It never outlives the API process: the kernel sends it SIGKILL when its parent dies
(PR_SET_PDEATHSIG), and a closed input pipe (EOF) ends the loop as well. SIGINT and
SIGTERM sent to the process group are left to the API process, which drains its
requests and then shuts this one down. A fault no request
explains (engine/core.py) is sent as `Failed` before the process exits non-zero.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Protocol

from engine.config import EngineConfig
from engine.ipc import (
    Codec,
    EngineInputs,
    Failed,
    Ready,
    Snapshot,
    StepOutputs,
    TokenUpdate,
)
from scheduler import EngineCoreOutput

if TYPE_CHECKING:
    from engine.core import EngineCore

logger = logging.getLogger("specbudget.engine")
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it dies."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Channel(Protocol):
    """What the loop needs of either end: a multiprocessing `Connection` (a pipe to
    the API process), or engine/replica.py's in-process queue (a Ray actor)."""

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message (or the end) is there, waiting up to `timeout` (None:
        until there is)."""

    def recv_bytes(self) -> bytes:
        """The next message; EOFError at the end."""

    def send_bytes(self, buf: bytes) -> None: ...


class CoreLoop:
    """One engine core behind two channels; see the module docstring."""

    def __init__(self, core: EngineCore, inputs: Channel, outputs: Channel) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.codec = Codec()
        self._refused: list[tuple[str, str]] = []

    def run(self) -> None:
        """Until the API process asks to stop or goes away."""
        while True:
            busy = self.core.has_unfinished_requests()
            # Idle, wait for work; busy, take only what is already there.
            if not self.inputs.poll(0 if busy else None):
                if busy:
                    self._step()
                continue
            if not self._apply_all():
                return
            if self.core.has_unfinished_requests():
                self._step()
            else:  # aborted or refused down to idle: the API side sees the KV freed
                self._send([])

    def _apply_all(self) -> bool:
        """Apply every message waiting; False once told to shut down (or on EOF)."""
        while self.inputs.poll(0):
            try:
                data = self.inputs.recv_bytes()
            except EOFError:
                return False
            if not self._apply(self.codec.decode_inputs(data)):
                return False
        return True

    def _apply(self, message: EngineInputs) -> bool:
        core = self.core
        for request_id in message.aborts:
            core.abort_request(request_id)
        for request_id in message.stops:
            core.stop_request(request_id)
        for new in message.adds:
            try:
                core.add_request(new.to_request())
            except ValueError as err:
                self._refused.append((new.request_id, str(err)))
        return not message.shutdown

    def _step(self) -> None:
        updates = self.core.step()
        self._send(updates)

    def _send(self, updates: list[EngineCoreOutput]) -> None:
        sched = self.core.scheduler
        snapshot = Snapshot(len(sched.running), len(sched.waiting), sched.kv_cache_usage(),
                            dict(self.core.runner.last_pass_rows), sched.stats)
        refused, self._refused = self._refused, []
        message = StepOutputs([TokenUpdate.of(u) for u in updates], refused, snapshot)
        self.outputs.send_bytes(self.codec.encode(message))


def run_core(config: EngineConfig, inputs: Channel, outputs: Channel, node: str = "") -> int:
    """Load the engine, say `Ready`, serve until told to stop or the other side goes
    away; 0 then, 1 after a fault (sent as `Failed` first: `ValueError` at start means
    settings the engine refused). Shared by the child process and the Ray replica."""
    from engine.core import EngineCore  # here: the API process never loads the engine

    codec = Codec()

    def last_word(err: BaseException) -> None:
        with contextlib.suppress(OSError):
            outputs.send_bytes(codec.encode(Failed(type(err).__name__, str(err))))

    try:
        core = EngineCore(config)
    except ValueError as err:  # settings that cannot run: the API process says which
        last_word(err)
        return 1
    # What is loaded now lives as long as the process. Frozen, a full collection scans
    # only what serving makes: over the ~320,000 objects torch, the tokenizer and the
    # model leave, each one cost 8-130 ms of some step (engine/heap.py).
    gc.collect()
    gc.freeze()
    try:
        outputs.send_bytes(codec.encode(Ready(os.getpid(), core.runner.dtype_description,
                                              node)))
        CoreLoop(core, inputs, outputs).run()
    except (EOFError, BrokenPipeError):
        return 0  # the API process went away: nothing left to serve
    except Exception as err:
        logger.exception("engine core failed")
        last_word(err)
        return 1
    return 0


def engine_main(config: EngineConfig, inputs: Connection, outputs: Connection,
                log_level: int = logging.INFO) -> None:
    """The child's entry point; see the module docstring."""
    die_with_parent()
    # Ctrl-C and a service manager's SIGTERM reach the whole process group; the API
    # process drains its requests first and then stops this one (or kills it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    if run_core(config, inputs, outputs) != 0:
        raise SystemExit(1)
