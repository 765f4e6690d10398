"""`specbudget serve` as an operator runs it: a real process, real signals."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

pytestmark = pytest.mark.model  # loads the real default model

C = "/v1/completions"
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve_process(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specbudget", "serve", "--port", str(port), "--max-model-len",
         "512", "--kv-cache-memory", "64M", "--log-level", "warning", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def stream_events(base: str) -> list[str]:
    """The `data:` lines of one long streamed completion, however it ends."""
    with httpx.stream("POST", base + C, json={**LONG, "stream": True}, timeout=60) as response:
        return [line for line in response.iter_lines() if line.startswith("data: ")]


def test_sigterm_ends_requests_in_flight_after_the_shutdown_timeout() -> None:
    with serve_process("--shutdown-timeout", "1") as (proc, base):
        results: dict[str, object] = {}

        def stream() -> None:
            results["events"] = stream_events(base)

        def plain() -> None:
            results["plain"] = httpx.post(base + C, json=LONG, timeout=60)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)  # both are generating (400 tokens take far longer)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        # uvicorn re-raises the captured SIGTERM once shut down, as every uvicorn app does.
        assert proc.wait(60) in (0, -signal.SIGTERM)
        elapsed = time.monotonic() - sent
    events = results["events"]
    assert isinstance(events, list) and events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and "1 s" in error["message"]
    plain_response = results["plain"]
    assert isinstance(plain_response, httpx.Response) and plain_response.status_code == 503
    assert plain_response.json()["error"]["code"] == "server_shutting_down"
    assert elapsed < 30  # bounded by the timeout, not by 400 tokens of generation


def test_serve_refuses_to_start_with_a_kv_cache_too_small_for_one_request() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "specbudget", "serve", "--port", str(free_port()),
         "--max-model-len", "2048", "--kv-cache-memory", "16M"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "cannot hold one request of max_model_len=2048" in proc.stderr
    assert "--kv-cache-memory" in proc.stderr and "Traceback" not in proc.stderr


def test_sigterm_answers_a_half_sent_upload_and_exits_within_the_timeout() -> None:
    """A body still arriving at shutdown gets the JSON 503 (it got a text/plain 500 and a
    CancelledError traceback), and the process exits within the shutdown timeout plus a
    small constant (it waited for uvicorn's own cutoff, int(timeout) + 5 s)."""
    timeout = 2.0
    with serve_process("--shutdown-timeout", str(timeout)) as (proc, base):
        port = int(base.rsplit(":", 1)[1])
        upload = socket.create_connection(("127.0.0.1", port), timeout=30)
        upload.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                       b"application/json\r\ncontent-length: 1000\r\n\r\n{\"prompt\":")
        results: dict[str, object] = {}

        def stream() -> None:
            results["events"] = stream_events(base)

        thread = threading.Thread(target=stream)
        thread.start()
        time.sleep(1.0)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        received = b""
        while chunk := upload.recv(65536):
            received += chunk
        upload.close()
        thread.join(60)
        assert proc.wait(60) in (0, -signal.SIGTERM)
        elapsed = time.monotonic() - sent
        log = proc.stdout.read() if proc.stdout else ""
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), received
    assert json.loads(body)["error"]["code"] == "server_shutting_down"
    events = results["events"]
    assert isinstance(events, list) and events[-1] == "data: [DONE]"
    assert "Traceback" not in log and "CancelledError" not in log, log
    # The old path: uvicorn's cutoff at int(2) + 5 = 7 s; now the timeout + 1 s grace.
    assert elapsed < timeout + 3.5
