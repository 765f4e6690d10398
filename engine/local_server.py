"""The OpenAI server in a background thread of this process (benchmarks, tests).

uvicorn serves on a socket bound here, on 127.0.0.1 port 0, so there is no race for a
free port; the engine thread and the server's event loop are both in this process.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from engine.connection_limits import ConnectionLimits
from engine.errors import EngineShutdownError
from engine.http_protocol import guarded_protocol
from engine.serving import ServingEngine

DEFAULT_SHUTDOWN_TIMEOUT = 5.0  # seconds; uvicorn's and vLLM's order of magnitude


def uvicorn_config(app: Any, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for `app` (from `build_app`) with the app's connection limits:
    the guarded HTTP protocol (header timeout, connection cap) and the keep-alive."""
    limits: ConnectionLimits = app.state.limits
    return uvicorn.Config(app, http=guarded_protocol(limits),
                          timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]
                          **kwargs)  # (uvicorn uses the keep-alive as a float delay)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown, after `shutdown_timeout` seconds, fails the
    engine's requests still in flight and the request bodies still arriving (each
    client gets its JSON 503 or stream error event; uvicorn's own timeout would cut
    streams mid-event and answer text/plain 500)."""

    # What answering every client takes once the timeout has failed them; only then
    # does uvicorn cancel what is left.
    GRACE_S = 1.0

    def __init__(self, config: uvicorn.Config, engine: ServingEngine,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        # uvicorn's cancel-everything timeout only backs ours up (it takes a float).
        config.timeout_graceful_shutdown = shutdown_timeout + self.GRACE_S  # type: ignore[assignment]

    def _fail_in_flight(self) -> None:
        self.engine.fail_all(EngineShutdownError(
            f"the server is shutting down: request still running after the "
            f"{self.shutdown_timeout:g} s shutdown timeout"))
        closing = getattr(getattr(self.config.app, "state", None), "closing", None)
        if closing is not None:
            closing.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.shutdown_timeout, self._fail_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


class ServerThread:
    """uvicorn serving `app` (from `build_app`: its connection limits come with it) on
    127.0.0.1 at a free port, in a daemon thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", log_level: str = "warning",
                 engine: ServingEngine | None = None,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.port = int(self.sock.getsockname()[1])
        self.base_url = f"http://{host}:{self.port}"
        config = uvicorn_config(app, log_level=log_level, timeout_graceful_shutdown=5)
        self.server = (uvicorn.Server(config) if engine is None
                       else DrainingServer(config, engine, shutdown_timeout))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="specbudget-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


@contextmanager
def serve_in_thread(engine: ServingEngine, served_model_name: str,
                    log_level: str = "warning",
                    limits: ConnectionLimits | None = None) -> Iterator[ServerThread]:
    """Serve `engine` (with its metrics) until the block ends; the engine stays up."""
    from engine.server import build_app

    thread = ServerThread(build_app(engine, served_model_name, limits=limits),
                          log_level=log_level, engine=engine)
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()
