"""Slow, idle and vanishing clients : a real uvicorn with short
limits, raw sockets playing the client. Nothing a client does may hold a connection
past its timeout, flood the log, or slow /health down."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.connection_limits import ConnectionLimits
from tests.server_helpers import ServerThread, make_engine, serve

pytestmark = pytest.mark.model  # loads the real default model

LIMITS = ConnectionLimits(header_timeout=1.0, keep_alive_timeout=1.0, body_timeout=1.0,
                          max_connections=8)
HEAD = ("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "content-length: 1000\r\n\r\n")


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    eng = make_engine(max_model_len=256, num_kv_blocks=64)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: AsyncEngine) -> Iterator[ServerThread]:
    with serve(engine, limits=LIMITS) as thread:
        yield thread


def _connect(server: ServerThread) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing, or None if it kept the socket open."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return None
    return received


def _wait_for_connections(server: ServerThread, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(server.server.server_state.connections) != count:
        assert time.monotonic() < deadline, len(server.server.server_state.connections)
        time.sleep(0.05)


def test_a_silent_connection_is_closed_after_the_header_timeout(server: ServerThread) -> None:
    with _connect(server) as sock:
        assert _closed_within(sock, 0.3) is None  # open for a while...
        assert _closed_within(sock, 5) == b""  # ...then closed, with nothing sent


def test_headers_trickled_byte_by_byte_do_not_hold_the_connection(
        server: ServerThread) -> None:
    """uvicorn's own keep-alive timer restarts on every byte; the header timer does not."""
    with _connect(server) as sock:
        start = time.monotonic()
        try:
            for byte in HEAD.encode():
                sock.send(bytes([byte]))
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _closed_within(sock, 5) is not None
        # The headers would take 0.1 s x ~90 bytes = 9 s; the timeout is 1 s.
        assert time.monotonic() - start < 9


def test_a_body_that_stops_arriving_gets_408(server: ServerThread, engine: AsyncEngine) -> None:
    with _connect(server) as sock:
        sock.sendall(HEAD.encode() + b'{"prompt":')
        response = _closed_within(sock, 10)
    assert response is not None
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "--body-timeout" in error["message"]
    assert not engine.core.has_unfinished_requests()


def test_a_client_leaving_mid_body_is_one_quiet_line(server: ServerThread,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for _ in range(5):
        with _connect(server) as sock:
            sock.sendall(HEAD.encode() + b'{"prompt":')
    _wait_for_connections(server, 0)
    time.sleep(0.2)
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noisy, [r.getMessage() for r in noisy]
    assert "Traceback" not in caplog.text
    quiet = [r for r in caplog.records if r.name == "specbudget.server"
             and "left before sending its whole body" in r.getMessage()]
    assert len(quiet) == 5 and all(r.levelno == logging.DEBUG for r in quiet)


def test_past_the_connection_cap_a_new_connection_gets_503_and_health_recovers(
        server: ServerThread) -> None:
    held = [_connect(server) for _ in range(LIMITS.max_connections)]
    try:
        _wait_for_connections(server, LIMITS.max_connections)
        with _connect(server) as extra:
            response = _closed_within(extra, 5)
        assert response is not None and response.startswith(b"HTTP/1.1 503")
        error = json.loads(response.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "too_many_connections" and "--max-connections" in error[
            "message"]
    finally:
        for sock in held:
            sock.close()
    _wait_for_connections(server, 0)
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def test_health_answers_while_slow_clients_are_held(server: ServerThread) -> None:
    """Half-sent bodies and idle sockets below the cap: /health still answers at once."""
    slow = [_connect(server) for _ in range(3)]
    idle = [_connect(server) for _ in range(3)]
    try:
        for sock in slow:
            sock.sendall(HEAD.encode() + b'{"prompt":')
        response = httpx.get(server.base_url + "/health", timeout=5)
        assert response.status_code == 200
    finally:
        for sock in slow + idle:
            sock.close()
    _wait_for_connections(server, 0)


def test_an_idle_keep_alive_connection_is_closed(server: ServerThread) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_within(sock, 5) == b""
