"""How one API request's engine requests are pumped and its responses end.

`Choices` merges the n engine requests of one API request into one stream of deltas;
`until_disconnected` awaits work but gives up when the client leaves; `EventStream`
is the SSE response that closes its engine requests however the stream ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.formats import Job
from engine.output import RequestDelta
from engine.serving import ServingEngine

T = TypeVar("T")


class Choices:
    """The n engine requests of one API request, merged into one stream of deltas.

    Each choice is pumped by its own task into one queue; `close()` cancels the
    tasks, which closes each `AsyncEngine.generate` generator, which aborts its
    engine request if it has not finished.
    """

    def __init__(self, engine: ServingEngine, job: Job) -> None:
        self._queue: asyncio.Queue[tuple[int, RequestDelta | Exception]] = asyncio.Queue()
        self._pending = len(job.params)
        self._tasks = [
            asyncio.create_task(self._pump(i, engine.generate(
                f"{job.request_id}-{i}", job.prompt_token_ids, params, job.priority,
                buffered=not job.stream)))
            for i, params in enumerate(job.params)
        ]

    async def _pump(self, index: int, gen: AsyncIterator[RequestDelta]) -> None:
        try:
            async for delta in gen:
                self._queue.put_nowait((index, delta))
        except Exception as err:  # engine refusal (ValueError) or EngineDeadError
            self._queue.put_nowait((index, err))

    async def next(self) -> tuple[int, RequestDelta] | None:
        """The next delta of any choice; None once all finished; raises their error."""
        if self._pending == 0:
            return None
        index, item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        if item.finished:
            self._pending -= 1
        return index, item

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()  # a no-op for a finished task


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but give up (raising ClientGone) if the client disconnects."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise ClientGone()
    return task.result()


class EventStream(StreamingResponse):
    """SSE response that runs `on_close` however the stream ends (disconnect included)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
