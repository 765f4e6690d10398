"""One data-parallel replica: a whole engine (scheduler, KV cache, model) in one process.

`engine/data_parallel.py` runs this class as a Ray actor named `EngineReplica`
(`ray.remote` wraps it there, so this file needs no Ray to import). Its methods are
what the front end calls: `generate` streams a request's deltas back as they come (a
Ray streaming generator, nothing buffered), `load` reports the queue lengths the
router balances on, `metrics` the replica's own Prometheus samples.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.output import RequestDelta
from scheduler import SamplingParams


class EngineReplica:
    """An `AsyncEngine` behind the calls the data-parallel front end makes."""

    def __init__(self, config: EngineConfig, index: int, num_threads: int,
                 model_name: str) -> None:
        # Replicas on one machine split its cores rather than each taking all of them.
        torch.set_num_threads(num_threads)
        from engine.server import wire_engine_metrics

        self.index = index
        self.engine = AsyncEngine(config)
        self.registry = CollectorRegistry()
        self._unwire = wire_engine_metrics(self.engine, self.registry, model_name)

    def info(self) -> dict[str, Any]:
        import ray

        return {"index": self.index, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "num_threads": torch.get_num_threads()}

    def load(self) -> tuple[int, int]:
        """(waiting, running); raises once the engine died, so the front end sees it."""
        if not self.engine.is_alive:
            raise RuntimeError(f"replica {self.index}: engine is dead: {self.engine.dead!r}")
        return self.engine.load()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int) -> AsyncIterator[RequestDelta]:
        async for delta in self.engine.generate(request_id, prompt_token_ids, params,
                                                priority):
            yield delta

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def metrics(self) -> list[Metric]:
        return list(self.registry.collect())

    def shutdown(self) -> None:
        self._unwire()
        self.engine.shutdown()
