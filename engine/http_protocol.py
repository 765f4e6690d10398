"""uvicorn's HTTP/1.1 protocol with the limits a public server needs and uvicorn lacks.

uvicorn arms its keep-alive timer only after a response, and cancels it on any byte
received, so a socket that never sends a request, or sends its headers a byte every
half second, is held forever; and `limit_concurrency` counts a connection only once
its headers are complete. Measured against the previous server: 5,000 half-open
connections held 5,009 file descriptors and +96 MB. Here:

- **header timeout**: a connection must complete a request's headers within
  `header_timeout` seconds of opening (or of its previous response), however slowly
  it trickles bytes, or it is closed;
- **idle keep-alive**: uvicorn's own `timeout_keep_alive` (see `ConnectionLimits`);
- **connection cap**: past `max_connections` open connections, a new one gets a JSON
  503 and is closed at once, before it can hold anything;
- the **body timeout** is the app's (`engine/server.py`: 408 as an OpenAI error).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.connection_limits import ConnectionLimits
from engine.protocol import APIError


def _refusal(status: str, error: APIError) -> bytes:
    """A whole HTTP response carrying `error`'s OpenAI error object, then close."""
    body = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class _GuardedH11(H11Protocol):
    limits: ConnectionLimits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.write(_refusal("503 Service Unavailable", APIError(
                f"The server has {self.limits.max_connections} connections open, its limit "
                "(--max-connections); retry later", status=503,
                code="too_many_connections", type="server_error")))
            transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers are complete
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request's headers, however slow

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout,
                                                  self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        waiting = self.cycle is None or self.cycle.response_complete
        if waiting and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """The protocol class to give `uvicorn.Config(http=...)`, with these limits."""
    return type("GuardedH11Protocol", (_GuardedH11,), {"limits": limits})
