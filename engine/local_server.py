"""The OpenAI server in a background thread of this process (benchmarks, tests).

uvicorn serves on a socket bound here, on 127.0.0.1 port 0, so there is no race for a
free port; the engine thread and the server's event loop are both in this process.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from engine.async_engine import AsyncEngine


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 at a free port, in a daemon thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", log_level: str = "warning") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.port = int(self.sock.getsockname()[1])
        self.base_url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
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
def serve_in_thread(engine: AsyncEngine, served_model_name: str,
                    log_level: str = "warning") -> Iterator[ServerThread]:
    """Serve `engine` (with its metrics) until the block ends; the engine stays up."""
    from engine.server import build_app

    thread = ServerThread(build_app(engine, served_model_name), log_level=log_level)
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()
