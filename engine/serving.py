"""What the server needs of an engine (light: the API process imports it without the
engine core): `AsyncEngine` (the engine on a thread of this process), `ProcessEngine`
(in its own process) or `DataParallelEngine` (replicas on Ray)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from engine.config import EngineConfig
    from engine.output import RequestDelta
    from engine.tokenizer import Tokenizer
    from scheduler import SamplingParams


class ServingEngine(Protocol):
    """What the server needs of an engine: `AsyncEngine` (one engine in this process)
    or `DataParallelEngine` (replicas on Ray)."""

    config: EngineConfig
    tokenizer: Tokenizer

    @property
    def is_alive(self) -> bool: ...

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, priority: int = 0,
                 buffered: bool = False) -> AsyncIterator[RequestDelta]:
        """`buffered`: the caller shows nothing before the request ends (a non-streamed
        response), so an engine that can lose a request midway (a replica) may start
        it again elsewhere instead of failing it."""

    def abort(self, request_id: str) -> None: ...

    def fail_all(self, error: BaseException) -> int: ...

    def health(self) -> tuple[bool, dict[str, Any]]: ...

    def export_metrics(self, registry: CollectorRegistry,
                       model_name: str) -> Callable[[], None]: ...

    def shutdown(self) -> None: ...


@dataclass
class DeltaStream:
    """Where an engine puts one request's deltas (or the exception that ends it),
    and the event loop its caller awaits them on."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestDelta | BaseException]


async def queued_deltas(queue: asyncio.Queue[RequestDelta | BaseException],
                        abort: Callable[[], None]) -> AsyncIterator[RequestDelta]:
    """One request's deltas from the queue its engine fills, up to the finished one;
    an exception put there is raised (the engine ended the request). A caller that
    leaves before the end (a disconnect) calls `abort`."""
    finished = False
    try:
        while not finished:
            item = await queue.get()
            if isinstance(item, BaseException):
                finished = True  # nothing left to abort: the engine ended it
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            abort()
