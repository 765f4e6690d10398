"""N engine replicas on Ray behind one front end (`specbudget serve --data-parallel-size N`).

Each replica is a Ray actor (`EngineReplica`, engine/replica.py) holding a whole
engine; this process keeps the tokenizer, the router and the HTTP server, and
`DataParallelEngine` stands where `AsyncEngine` stands for one engine (the server
takes either). Ray is imported here only, and only when N > 1.

- **Routing** (engine/routing.py): least loaded by 4·waiting + running, prefix
  affinity on ties. Deltas stream back as the replica yields them (a Ray streaming
  generator), never buffered whole.
- **Health**: a monitor thread asks every replica for its load (and its metrics)
  every `health_interval_s`; a replica whose call fails is dead (its engine faulted,
  or its process is gone), one that Ray is restarting is starting, and a replica
  that answers again is ready. Ray restarts dead replicas (`max_restarts=-1`; one
  whose engine faulted is killed first so that Ray replaces it).
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
from engine.errors import EngineDeadError, EngineShutdownError, ReplicaFailedError
from engine.output import RequestDelta
from engine.replica import EngineReplica
from engine.routing import ReplicaLoad, ReplicaState, pick_replica
from engine.tokenizer import Tokenizer
from runner.model_prep import resolve_model
from scheduler import SamplingParams

logger = logging.getLogger("specbudget.data_parallel")
RAY_HINT = ("data_parallel_size > 1 runs replicas on Ray, which is not installed: "
            "pip install -e '.[ray]' (make install does)")


class _Replica:
    """One actor and what the front end knows of it."""

    def __init__(self, index: int, actor: Any) -> None:
        self.actor = actor
        self.load = ReplicaLoad(index)
        self.info: dict[str, Any] = {}
        self.metrics: list[Metric] = []
        self.error: str | None = None
        self.num_routed = 0  # requests sent to it (re-sends included)

    def describe(self) -> dict[str, Any]:
        return {"replica": self.load.index, "state": self.load.state.value,
                "waiting": self.load.waiting, "running": self.load.running,
                **{k: self.info[k] for k in ("pid", "node_id") if k in self.info},
                **({"error": self.error} if self.error else {})}


class DataParallelEngine:
    """`AsyncEngine`'s serving interface over N replicas; see the module docstring."""

    def __init__(self, config: EngineConfig, data_parallel_size: int,
                 ray_address: str | None = None, model_name: str = "default",
                 num_threads: int | None = None, health_interval_s: float = 0.5) -> None:
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
        self.tokenizer = Tokenizer.from_dir(resolve_model(config.model))
        threads = num_threads or max(1, (os.cpu_count() or 1) // data_parallel_size)
        actor_class = ray.remote(EngineReplica).options(
            max_restarts=-1, max_task_retries=0, num_cpus=threads,
            scheduling_strategy="SPREAD")
        self.replicas = [_Replica(i, actor_class.remote(config, i, threads, model_name))
                         for i in range(data_parallel_size)]
        self.health_interval_s = health_interval_s
        self.num_resent = 0
        self.num_failed_streams = 0
        self._streams: dict[str, tuple[_Replica, Any]] = {}
        self._closing: BaseException | None = None
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="specbudget-dp-health",
                                         daemon=True)
        self._monitor.start()

    # ---- health ----------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return any(r.load.state is ReplicaState.READY for r in self.replicas)

    def health(self) -> tuple[bool, dict[str, Any]]:
        return self.is_alive, {"replicas": [r.describe() for r in self.replicas]}

    def wait_ready(self, timeout: float = 300.0, every: bool = False) -> None:
        """Block until one replica (`every`: all of them) is ready."""
        deadline = time.monotonic() + timeout
        while not (all if every else any)(r.load.state is ReplicaState.READY
                                          for r in self.replicas):
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas not ready after {timeout:g} s: "
                                   f"{[r.describe() for r in self.replicas]}")
            time.sleep(0.05)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self.health_interval_s)

    def _poll(self) -> None:
        ray = self._ray
        calls = [(r, r.actor.load.remote(), r.actor.metrics.remote()) for r in self.replicas]
        for replica, load_ref, metrics_ref in calls:
            try:
                (waiting, running), metrics = ray.get([load_ref, metrics_ref],
                                                      timeout=max(2.0, self.health_interval_s))
            except ray.exceptions.GetTimeoutError:
                continue  # busy loading or stepping: keep what we knew
            except ray.exceptions.ActorUnavailableError:
                replica.load.state = ReplicaState.STARTING  # Ray is restarting it
                continue
            except Exception as err:  # died, or its engine faulted (load raised)
                self._mark_dead(replica, err)
                continue
            if replica.load.state is not ReplicaState.READY:
                try:  # bounded, like the calls above: the monitor must never hang
                    replica.info = ray.get(replica.actor.info.remote(),
                                           timeout=max(2.0, self.health_interval_s))
                except Exception:
                    continue  # asked again next round
                replica.error = None
                logger.info("replica %d ready (pid %s)", replica.load.index,
                            replica.info.get("pid"))
            load = replica.load
            load.waiting, load.running, load.sent = waiting, running, 0
            load.state = ReplicaState.READY
            replica.metrics = metrics

    def _mark_dead(self, replica: _Replica, err: BaseException) -> None:
        if replica.load.state is ReplicaState.DEAD:
            return
        logger.warning("replica %d failed: %r", replica.load.index, err)
        replica.load.state = ReplicaState.DEAD
        replica.error = type(err).__name__
        replica.metrics = []
        if not isinstance(err, self._ray.exceptions.RayActorError):
            # Its process lives on with a dead engine: kill it so that Ray restarts it.
            self._ray.kill(replica.actor, no_restart=False)

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
            stream = replica.actor.generate.options(num_returns="streaming").remote(
                request_id, prompt_token_ids, params, priority)
            self._streams[request_id] = (replica, stream)
            emitted = finished = False
            held: list[RequestDelta] = []
            try:
                async for ref in stream:
                    delta: RequestDelta = await ref
                    finished = delta.finished
                    if buffered:
                        held.append(delta)
                    else:
                        emitted = True
                        yield delta
                for delta in held:
                    yield delta
                return
            except Exception as raised:
                if self._closing is not None:
                    raise self._closing from None
                err = self._unwrap(raised)
                if not self._replica_failed(err):
                    raise err from None  # the request's own error: a refusal, a traced fault
                self._mark_dead(replica, err)
                if emitted:
                    self.num_failed_streams += 1
                    raise ReplicaFailedError(
                        f"replica {replica.load.index} failed while streaming: "
                        f"{type(err).__name__}") from None
                self.num_resent += 1
                tried.add(replica.load.index)
                logger.warning("request %s: replica %d failed before the client saw a "
                               "token; sending it to another", request_id, replica.load.index)
            finally:
                self._streams.pop(request_id, None)
                if not finished:
                    self._cancel(replica, stream, request_id)

    def _route(self, prompt_token_ids: list[int], tried: set[int]) -> _Replica:
        if self._closing is not None:
            raise self._closing
        load = pick_replica([r.load for r in self.replicas], prompt_token_ids,
                            self.config.block_size, frozenset(tried))
        if load is None:
            raise EngineDeadError("no engine replica is ready: "
                                  f"{[r.describe() for r in self.replicas]}")
        load.sent += 1
        replica = self.replicas[load.index]
        replica.num_routed += 1
        return replica

    def _unwrap(self, err: Exception) -> Exception:
        """The replica's own exception (a ValueError refusal, RequestFailedError, ...)
        rather than Ray's wrapper, whose message carries the remote traceback."""
        cause = getattr(err, "cause", None)
        if isinstance(err, self._ray.exceptions.RayTaskError) and isinstance(cause, Exception):
            return cause
        return err

    def _replica_failed(self, err: BaseException) -> bool:
        """An actor gone, or its engine dead: not this request's fault."""
        return isinstance(err, (self._ray.exceptions.RayActorError, EngineDeadError))

    def _cancel(self, replica: _Replica, stream: Any, request_id: str) -> None:
        if replica.load.state is ReplicaState.DEAD:
            return
        try:
            self._ray.cancel(stream)
            replica.actor.abort.remote(request_id)
        except Exception:  # already gone: nothing left to abort
            logger.debug("abort of %s on replica %d failed", request_id, replica.load.index)

    def abort(self, request_id: str) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            self._cancel(entry[0], entry[1], request_id)

    def fail_all(self, error: BaseException) -> int:
        """End every request in flight with `error` (a shutdown that stops waiting)."""
        self._closing = error
        streams = list(self._streams.items())
        for request_id, (replica, stream) in streams:
            self._cancel(replica, stream, request_id)
        return len(streams)

    def shutdown(self) -> None:
        self._closing = self._closing or EngineShutdownError("the engine is shutting down")
        self._stop.set()
        self._monitor.join(timeout=5)
        for replica in self.replicas:
            self._ray.kill(replica.actor, no_restart=True)
        if self._started_ray:
            self._ray.shutdown()

    # ---- metrics ---------------------------------------------------------------------

    def export_metrics(self, registry: CollectorRegistry,
                       model_name: str) -> Callable[[], None]:
        """Every replica's `specbudget:*` metrics with a `replica` label, plus the
        front end's own; returns the undo."""
        collector = _ReplicaCollector(self)
        registry.register(collector)
        return lambda: registry.unregister(collector)


class _ReplicaCollector:
    """Merges the replicas' last metric snapshots (from the monitor; no call here)."""

    def __init__(self, engine: DataParallelEngine) -> None:
        self.engine = engine

    def collect(self) -> list[Metric]:
        merged: dict[str, Metric] = {}
        for replica in self.engine.replicas:
            label = str(replica.load.index)
            for family in replica.metrics:
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
