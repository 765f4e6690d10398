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

from engine.async_engine import EngineShutdownError, ServingEngine

DEFAULT_SHUTDOWN_TIMEOUT = 5.0  # seconds; uvicorn's and vLLM's order of magnitude


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown fails the engine's requests still in flight after
    `shutdown_timeout` seconds (uvicorn's own timeout would cut streams mid-event)."""

    def __init__(self, config: uvicorn.Config, engine: ServingEngine,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        # uvicorn's cancel-everything timeout only backs ours up.
        config.timeout_graceful_shutdown = int(shutdown_timeout) + 5

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        error = EngineShutdownError(
            f"the server is shutting down: request still running after the "
            f"{self.shutdown_timeout:g} s shutdown timeout")
        timer = loop.call_later(self.shutdown_timeout, self.engine.fail_all, error)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 at a free port, in a daemon thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", log_level: str = "warning",
                 engine: ServingEngine | None = None,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.port = int(self.sock.getsockname()[1])
        self.base_url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
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
                    log_level: str = "warning") -> Iterator[ServerThread]:
    """Serve `engine` (with its metrics) until the block ends; the engine stays up."""
    from engine.server import build_app

    thread = ServerThread(build_app(engine, served_model_name), log_level=log_level,
                          engine=engine)
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()
