"""N engine replicas on Ray behind one front end (`specbudget serve --data-parallel-size N`).

Each replica is a Ray actor (`EngineReplica`, engine/replica.py) running the same
engine-core loop as the engine process of `specbudget serve` with one replica
(engine/core_process.py), and this process fronts each with the same `CoreClient`
(engine/core_client.py): one message format (engine/ipc.py) and one front end for
both layouts. Requests added in one turn of the event loop go to a replica as one
message; each step comes back as one message with every request's new token ids,
detokenised here. This process keeps the tokenizer, the router and the HTTP server;
`DataParallelEngine` stands where `ProcessEngine` stands for one engine. Ray is
imported here only, and only when N > 1.

- **Routing** (engine/routing.py): least loaded by 4·waiting + running, counted
  from what this front end has in flight on each replica and its last step; prefix
  affinity on ties.
- **Health**: one reader thread per replica follows its output stream. `Ready`
  makes it ready; the stream breaking (the actor's process died) or ending after
  `Failed` (its engine faulted; the actor is then killed) makes it dead, and Ray
  restarts it (`max_restarts=-1`); the reader connects to the new one, which is
  ready when it says so. A replica whose settings the engine refuses at start is
  not restarted: `wait_ready` raises that ValueError.
- **Failover**: a request whose replica dies before the client saw anything is sent
  to another ready replica: a stream that has sent nothing yet, and any non-streamed
  request (`buffered`: its deltas are held until it ends, so it is re-sent even from
  midway). Only a stream that already sent tokens ends with `ReplicaFailedError` (the
  server sends an error event, then `[DONE]`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from engine.config import EngineConfig
from engine.core_client import CoreClient
from engine.errors import (
    EngineDeadError,
    EngineProcessDiedError,
    EngineShutdownError,
    ReplicaFailedError,
)
from engine.ipc import Codec, Failed, Ready, StepOutputs
from engine.output import RequestDelta
from engine.replica import EngineReplica
from engine.routing import ReplicaLoad, ReplicaState, pick_replica
from engine.tokenizer import Tokenizer
from runner.model_prep import resolve_model
from scheduler import SamplingParams

logger = logging.getLogger("specbudget.data_parallel")
RAY_HINT = ("data_parallel_size > 1 runs replicas on Ray, which is not installed: "
            "pip install -e '.[ray]' (make install does)")


class _ReplicaDown(EngineProcessDiedError):
    """Its replica died under this request: the front end may send it elsewhere."""


class _Replica:
    """One actor, the client fronting it, and what the router knows of it."""

    def __init__(self, index: int, actor: Any, engine: DataParallelEngine) -> None:
        self.actor = actor
        self.load = ReplicaLoad(index)
        self.client = CoreClient(engine.config, engine.tokenizer, self._push, self._gate,
                                 name=f"replica {index}")
        self.info: dict[str, Any] = {}
        self.error: str | None = None
        self.start_error: str | None = None  # settings refused: not restarted
        self.num_routed = 0  # requests sent to it (re-sends included)
        self.epoch = 0  # connections to the actor so far (engine/replica.py push)
        self._seq = 0
        self._seq_lock = threading.Lock()

    def connect(self) -> None:
        with self._seq_lock:
            self.epoch += 1
            self._seq = 0

    def _push(self, data: bytes) -> None:
        with self._seq_lock:  # numbered in the order sent; the actor applies them so
            seq, self._seq = self._seq, self._seq + 1
            epoch = self.epoch
        try:
            self.actor.push.remote(epoch, seq, data)
        except Exception:  # gone: its reader fails the requests
            logger.debug("replica %d: message dropped", self.load.index)

    def _gate(self) -> None:
        if self.load.state is not ReplicaState.READY:
            raise _ReplicaDown(f"replica {self.load.index} is {self.load.state.value}")

    def describe(self) -> dict[str, Any]:
        waiting, running = self.client.load()
        return {"replica": self.load.index, "state": self.load.state.value,
                "waiting": waiting, "running": running,
                **{k: self.info[k] for k in ("pid", "node_id") if k in self.info},
                **({"error": self.error} if self.error else {})}


class DataParallelEngine:
    """`ServingEngine` over N replicas; see the module docstring."""

    def __init__(self, config: EngineConfig, data_parallel_size: int,
                 ray_address: str | None = None, model_name: str = "default",
                 num_threads: int | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise ImportError(RAY_HINT) from None
        self._ray = ray
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
        self.config = config
        self.size = data_parallel_size
        self.model_name = model_name
        self.tokenizer = Tokenizer.from_dir(resolve_model(config.model))
        threads = num_threads or max(1, (os.cpu_count() or 1) // data_parallel_size)
        actor_class = ray.remote(EngineReplica).options(
            max_restarts=-1, max_task_retries=0, num_cpus=threads,
            scheduling_strategy="SPREAD")
        self.replicas = [_Replica(i, actor_class.remote(config, i, threads), self)
                         for i in range(data_parallel_size)]
        self.num_resent = 0
        self.num_failed_streams = 0
        self._routed: dict[str, _Replica] = {}
        self._closing: BaseException | None = None
        self._codec = Codec()
        self._readers = [threading.Thread(target=self._follow, args=(r,), daemon=True,
                                          name=f"specbudget-dp-reader-{r.load.index}")
                         for r in self.replicas]
        for reader in self._readers:
            reader.start()

    # ---- health ----------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return any(r.load.state is ReplicaState.READY for r in self.replicas)

    def health(self) -> tuple[bool, dict[str, Any]]:
        return self.is_alive, {"replicas": [r.describe() for r in self.replicas]}

    def wait_ready(self, timeout: float = 300.0, every: bool = False) -> None:
        """Block until one replica (`every`: all of them) is ready; ValueError if the
        engine refused the settings."""
        deadline = time.monotonic() + timeout
        while not (all if every else any)(r.load.state is ReplicaState.READY
                                          for r in self.replicas):
            refused = [r.start_error for r in self.replicas if r.start_error]
            if refused:
                raise ValueError(refused[0])
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas not ready after {timeout:g} s: "
                                   f"{[r.describe() for r in self.replicas]}")
            time.sleep(0.05)

    def _follow(self, replica: _Replica) -> None:
        """The reader thread of one replica, across its restarts (module docstring)."""
        ray = self._ray
        while self._closing is None:
            replica.connect()
            failed: Failed | None = None
            broken = False
            try:
                stream = replica.actor.outputs.options(num_returns="streaming").remote()
                for ref in stream:
                    batch = ray.get(ref)
                    try:
                        for data in batch:
                            failed = self._on_message(replica, data) or failed
                    except Exception:  # ours: the replica is useless without its reader
                        logger.exception("failed handling replica %d's output; replacing it",
                                         replica.load.index)
                        failed = Failed("RuntimeError",
                                        "the front end failed handling the replica's output")
                        break
            except Exception as err:  # its process died: RayActorError, or
                broken = True  # ActorUnavailableError while Ray restarts it
                failed = failed or Failed(type(err).__name__, "the replica's process died")
            if self._closing is not None:
                return
            if not self._replica_died(replica, failed, broken):
                return
            time.sleep(0.2)

    def _on_message(self, replica: _Replica, data: bytes) -> Failed | None:
        message = self._codec.decode_outputs(data)
        if isinstance(message, StepOutputs):
            replica.client.on_outputs(message)
        elif isinstance(message, Ready):
            self._on_ready(replica, message)
        elif isinstance(message, Failed):
            return message
        return None

    def _on_ready(self, replica: _Replica, message: Ready) -> None:
        replica.info = {"pid": message.pid, "node_id": message.node}
        replica.error = None
        replica.load.state = ReplicaState.READY
        logger.info("replica %d ready (pid %d, %s)", replica.load.index, message.pid,
                    message.description)

    def _replica_died(self, replica: _Replica, failed: Failed | None, broken: bool) -> bool:
        """Mark it dead and fail its requests; whether to wait for Ray's restart."""
        was_ready = replica.load.state is ReplicaState.READY
        reason = failed.error if failed else "its output stream ended"
        if replica.load.state is not ReplicaState.DEAD:  # not again while Ray restarts it
            logger.warning("replica %d failed: %s", replica.load.index, reason)
            replica.error = reason
        replica.load.state = ReplicaState.DEAD
        replica.client.fail_streams(_ReplicaDown(f"replica {replica.load.index}: {reason}"))
        if not was_ready and failed is not None and failed.kind == "ValueError":
            replica.start_error = failed.message  # settings refused: a restart cannot help
            self._ray.kill(replica.actor, no_restart=True)
            return False
        if not broken:  # its process lives on with a dead engine: Ray replaces a killed one
            self._ray.kill(replica.actor, no_restart=False)
        return True

    # ---- requests --------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0,
                       buffered: bool = False) -> AsyncIterator[RequestDelta]:
        """Stream one request from the replica the router picks; see the module
        docstring for what happens when that replica dies. `buffered`: the deltas are
        held until the request ends, so a replica dying midway costs a re-send, not the
        request (greedy and seeded requests then return exactly what they would have)."""
        tried: set[int] = set()
        while True:
            replica = self._route(prompt_token_ids, tried)
            self._routed[request_id] = replica
            emitted = finished = False
            held: list[RequestDelta] = []
            try:
                async for delta in replica.client.generate(request_id, prompt_token_ids,
                                                           params, priority):
                    finished = delta.finished
                    if buffered:
                        held.append(delta)
                    else:
                        emitted = True
                        yield delta
                for delta in held:
                    yield delta
                return
            except _ReplicaDown as err:
                if self._closing is not None:
                    raise self._closing from None
                finished = True  # the replica's client has dropped it
                if emitted:
                    self.num_failed_streams += 1
                    raise ReplicaFailedError(
                        f"replica {replica.load.index} failed while streaming: {err}") from None
                self.num_resent += 1
                tried.add(replica.load.index)
                logger.warning("request %s: replica %d failed before the client saw a "
                               "token; sending it to another", request_id, replica.load.index)
            except Exception:  # the client ended it: a refusal, a traced fault, fail_all
                finished = True
                if self._closing is not None:
                    raise self._closing from None
                raise
            finally:
                self._routed.pop(request_id, None)
                if not finished:  # left early (a disconnect): the replica stops it now
                    replica.client.abort(request_id)

    def _route(self, prompt_token_ids: list[int], tried: set[int]) -> _Replica:
        if self._closing is not None:
            raise self._closing
        for r in self.replicas:  # what this front end has in flight there, and its last step
            r.load.waiting, r.load.running = r.client.load()
        load = pick_replica([r.load for r in self.replicas], prompt_token_ids,
                            self.config.block_size, frozenset(tried))
        if load is None:
            raise EngineDeadError("no engine replica is ready: "
                                  f"{[r.describe() for r in self.replicas]}")
        replica = self.replicas[load.index]
        replica.num_routed += 1
        return replica

    def abort(self, request_id: str) -> None:
        replica = self._routed.get(request_id)
        if replica is not None:
            replica.client.abort(request_id)

    def fail_all(self, error: BaseException) -> int:
        """End every request in flight with `error` (a shutdown that stops waiting)."""
        self._closing = error
        return sum(r.client.fail_all(error) for r in self.replicas)

    def shutdown(self) -> None:
        self._closing = self._closing or EngineShutdownError("the engine is shutting down")
        for replica in self.replicas:
            replica.client.fail_streams(self._closing)
            self._ray.kill(replica.actor, no_restart=True)
        for reader in self._readers:
            reader.join(timeout=5)
        if self._started_ray:
            self._ray.shutdown()

    # ---- metrics ---------------------------------------------------------------------

    def export_metrics(self, registry: CollectorRegistry,
                       model_name: str) -> Callable[[], None]:
        """Every replica's `specbudget:*` metrics with a `replica` label (each fed from
        its step messages, like one engine's), plus the front end's own; returns the
        undo."""
        from engine.metrics import wire_step_metrics

        own = [CollectorRegistry() for _ in self.replicas]
        unwires = [wire_step_metrics(r.client.on_step, reg, model_name)
                   for r, reg in zip(self.replicas, own)]
        collector = _ReplicaCollector(self, own)
        registry.register(collector)

        def undo() -> None:
            registry.unregister(collector)
            for unwire in unwires:
                unwire()

        return undo


class _ReplicaCollector:
    """Merges the replicas' metrics, kept here from their step messages (no call out)."""

    def __init__(self, engine: DataParallelEngine, registries: list[CollectorRegistry]) -> None:
        self.engine = engine
        self.registries = registries

    def collect(self) -> list[Metric]:
        merged: dict[str, Metric] = {}
        for replica, own in zip(self.engine.replicas, self.registries):
            label = str(replica.load.index)
            for family in own.collect():
                out = merged.setdefault(family.name, Metric(family.name, family.documentation,
                                                            family.type, family.unit))
                for s in family.samples:
                    out.add_sample(s.name, {**s.labels, "replica": label}, s.value,
                                   s.timestamp, s.exemplar)
        states = GaugeMetricFamily("specbudget:replica_ready",
                                   "1 if the data-parallel replica serves, else 0",
                                   labels=["replica", "state"])
        for replica in self.engine.replicas:
            state = replica.load.state
            states.add_metric([str(replica.load.index), state.value],
                              float(state is ReplicaState.READY))
        resent = GaugeMetricFamily("specbudget:frontend_resent_requests",
                                   "Requests re-sent after their replica died before "
                                   "their first token", value=self.engine.num_resent)
        failed = GaugeMetricFamily("specbudget:frontend_failed_streams",
                                   "Streams ended by an error because their replica "
                                   "died mid-stream", value=self.engine.num_failed_streams)
        return [*merged.values(), states, resent, failed]
