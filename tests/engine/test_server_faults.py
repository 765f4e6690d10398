"""The server under bad input, disconnects and engine faults: every invalid request is
a 400 (404 for an unknown model) OpenAI error refused before the engine sees it; a
client that leaves gets its engine request aborted; a dead engine answers 500 to
requests in flight and 503 to new ones, and nothing hangs."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.llm import LLM
from scheduler import SamplingParams
from tests.server_helpers import MODEL_NAME, SPEC, ServerThread, default_model, make_engine, serve

pytestmark = pytest.mark.model  # loads the real default model

MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 40  # 640 token slots: one max_model_len request and then some
PROMPT = "The capital of France is"
LONG_RUN = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True}

C, H = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def cmpl(**fields: Any) -> bytes:
    return body(**{"prompt": PROMPT, **fields})


def chat(**fields: Any) -> bytes:
    return body(**{"messages": MSG, **fields})


# (id, path, raw body, param expected in the error (None: a JSON-level error), text the
# message must contain, HTTP status)
INVALID: list[tuple[str, str, bytes, str | None, str, int]] = [
    ("malformed-json", C, b'{"prompt": "hi",', None, "JSON", 400),
    ("not-an-object", C, b'["hi"]', None, "JSON object", 400),
    ("not-utf8", C, b'{"prompt": "\xff\xfe"}', None, "JSON", 400),
    ("nan-literal", C, b'{"prompt": "hi", "temperature": NaN}', "temperature", "NaN", 400),
    ("infinity-literal", C, b'{"prompt": "hi", "top_p": Infinity}', "top_p", "Infinity", 400),
    ("neg-infinity-literal", C, b'{"prompt": "hi", "min_p": -Infinity}', "min_p", "Infinity",
     400),
    ("overflow-to-inf", C, b'{"prompt": "hi", "temperature": 1e999}', "temperature", "finite",
     400),
    ("unknown-model", C, cmpl(model="gpt-4"), "model", "gpt-4", 404),
    ("missing-prompt", C, body(max_tokens=4), "prompt", "non-empty", 400),
    ("empty-prompt", C, cmpl(prompt=""), "prompt", "non-empty", 400),
    ("empty-token-list", C, cmpl(prompt=[]), "prompt", "non-empty", 400),
    ("token-id-past-vocab", C, cmpl(prompt=[1, 49152]), "prompt", "49152", 400),
    ("negative-token-id", C, cmpl(prompt=[-1, 5]), "prompt", "[0, 49152)", 400),
    ("bool-token-id", C, cmpl(prompt=[1, True]), "prompt", "integer", 400),
    ("two-prompts", C, cmpl(prompt=["a", "b"]), "prompt", "one prompt", 400),
    ("prompt-fills-context", C, cmpl(prompt=[5] * MAX_MODEL_LEN), "prompt", "512", 400),
    ("temperature-negative", C, cmpl(temperature=-0.5), "temperature", "[0, 2]", 400),
    ("temperature-above-2", C, cmpl(temperature=2.5), "temperature", "[0, 2]", 400),
    ("temperature-bool", C, cmpl(temperature=True), "temperature", "number", 400),
    ("temperature-string", C, cmpl(temperature="0.5"), "temperature", "number", 400),
    ("top-p-zero", C, cmpl(top_p=0), "top_p", "(0, 1]", 400),
    ("top-p-above-1", C, cmpl(top_p=1.5), "top_p", "(0, 1]", 400),
    ("top-k-below-minus-1", C, cmpl(top_k=-2), "top_k", "-1", 400),
    ("min-p-above-1", C, cmpl(min_p=1.5), "min_p", "[0, 1]", 400),
    ("max-tokens-zero", C, cmpl(max_tokens=0), "max_tokens", ">= 1", 400),
    ("max-tokens-float", C, cmpl(max_tokens=8.5), "max_tokens", "integer", 400),
    ("max-tokens-bool", C, cmpl(max_tokens=True), "max_tokens", "integer", 400),
    ("n-zero", C, cmpl(n=0), "n", "[1, 16]", 400),
    ("n-above-cap", C, cmpl(n=17), "n", "[1, 16]", 400),
    ("logprobs-above-20", C, cmpl(logprobs=21), "logprobs", "[0, 20]", 400),
    ("logprobs-negative", C, cmpl(logprobs=-1), "logprobs", "[0, 20]", 400),
    ("stop-not-string", C, cmpl(stop=[1]), "stop", "string", 400),
    ("stop-empty-string", C, cmpl(stop=""), "stop", "non-empty", 400),
    ("stop-token-id-past-vocab", C, cmpl(stop_token_ids=[99999]), "stop_token_ids.0", "49152",
     400),
    ("seed-past-int64", C, cmpl(seed=2 ** 64), "seed", str(2 ** 63 - 1), 400),
    ("seed-below-int64", C, cmpl(seed=-(2 ** 63) - 1), "seed", str(-(2 ** 63)), 400),
    # Each of these used to pass validation and then overflow an int64 in the engine.
    ("top-k-past-int64", C, cmpl(top_k=2 ** 63), "top_k", str(2 ** 63 - 1), 400),
    ("max-tokens-past-int64", C, cmpl(max_tokens=2 ** 63), "max_tokens", str(2 ** 63 - 1),
     400),
    ("priority-past-int64", C, cmpl(priority=2 ** 64), "priority", str(2 ** 63 - 1), 400),
    ("n-past-int64", C, cmpl(n=2 ** 70), "n", str(2 ** 63 - 1), 400),
    ("stop-token-id-past-int64", C, cmpl(stop_token_ids=[2 ** 63]), "stop_token_ids.0",
     str(2 ** 63 - 1), 400),
    ("logprobs-past-int64", C, cmpl(logprobs=2 ** 64), "logprobs", str(2 ** 63 - 1), 400),
    # More tokens than the context has room for: 400 naming all three numbers.
    ("max-tokens-past-context", C, cmpl(max_tokens=10 ** 12), "max_tokens",
     f"maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
     f"{5 + 10 ** 12} tokens (5 in the prompt, {10 ** 12} in the completion)", 400),
    ("max-tokens-one-past-context", C, cmpl(prompt=[5] * 500, max_tokens=13), "max_tokens",
     "at most 12", 400),
    ("chat-max-completion-tokens-past-context", H, chat(max_completion_tokens=10 ** 6),
     "max_completion_tokens", "maximum context length", 400),
    # Input that used to give 500.
    ("lone-surrogate-prompt", C, b'{"prompt": "hi \\ud800 there"}', "prompt", "surrogate",
     400),
    ("lone-surrogate-chat", H, b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages.0.content", "surrogate", 400),
    ("lone-surrogate-stop", C, b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop.0",
     "surrogate", 400),
    ("nested-10000-deep", C, b'{"prompt": "hi", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
     None, "nested deeper", 400),
    ("nested-100-deep", C, b'{"prompt": "hi", "x": ' + b"[" * 100 + b"]" * 100 + b"}",
     "x" + ".0" * 31, "nested deeper", 400),
    ("stream-options-without-stream", C, cmpl(stream_options={"include_usage": True}),
     "stream_options", "stream", 400),
    ("stream-not-bool", C, cmpl(stream="yes"), "stream", "boolean", 400),
    ("include-usage-not-bool", C, cmpl(stream=True, stream_options={"include_usage": 1}),
     "stream_options.include_usage", "boolean", 400),
    ("ignore-eos-not-bool", C, cmpl(ignore_eos=1), "ignore_eos", "boolean", 400),
    ("priority-float", C, cmpl(priority=1.5), "priority", "integer", 400),
    ("echo-unsupported", C, cmpl(echo=True), "echo", "not supported", 400),
    ("penalty-unsupported", C, cmpl(presence_penalty=0.5), "presence_penalty",
     "not supported", 400),
    ("repetition-penalty-unsupported", C, cmpl(repetition_penalty=1e30),
     "repetition_penalty", "not supported", 400),
    ("repetition-penalty-zero", C, cmpl(repetition_penalty=0), "repetition_penalty",
     "not supported", 400),
    ("min-tokens-negative", C, cmpl(min_tokens=-5), "min_tokens", ">= 0", 400),
    ("min-tokens-above-max-tokens", C, cmpl(min_tokens=100, max_tokens=4), "min_tokens",
     "at most max_tokens (4)", 400),
    ("chat-missing-messages", H, body(max_tokens=4), "messages", "non-empty", 400),
    ("chat-empty-messages", H, chat(messages=[]), "messages", "non-empty", 400),
    ("chat-bad-role", H, chat(messages=[{"role": "wizard", "content": "hi"}]),
     "messages.0.role", "user", 400),
    ("chat-user-without-content", H, chat(messages=[{"role": "user"}]),
     "messages.0.content", "required", 400),
    ("chat-user-null-content", H, chat(messages=[{"role": "user", "content": None}]),
     "messages.0.content", "required", 400),
    ("chat-content-number", H, chat(messages=[{"role": "user", "content": 5}]),
     "messages.0.content", "string", 400),
    ("chat-image-part", H, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]),
     "messages.0.content", "text", 400),
    ("chat-logprobs-int", H, chat(logprobs=5), "logprobs", "boolean", 400),
    ("chat-top-logprobs-above-20", H, chat(logprobs=True, top_logprobs=21), "top_logprobs",
     "[0, 20]", 400),
    ("chat-top-logprobs-without-logprobs", H, chat(top_logprobs=2), "top_logprobs",
     "logprobs", 400),
    ("chat-max-completion-tokens-zero", H, chat(max_completion_tokens=0),
     "max_completion_tokens", ">= 1", 400),
    ("chat-tools-unsupported", H, chat(tools=[{"type": "function"}]), "tools",
     "not supported", 400),
    ("chat-nan-top-p", H, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}',
     "top_p", "NaN", 400),
    ("chat-unknown-model", H, chat(model="other"), "model", "other", 404),
]


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    eng = make_engine(max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: AsyncEngine) -> Iterator[ServerThread]:
    with serve(engine) as thread:
        yield thread


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


@pytest.fixture
def engine_calls(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
                 ) -> dict[str, list[Any]]:
    """Spies on what reaches the engine core: ids added, (id, outputs so far) aborted."""
    calls: dict[str, list[Any]] = {"added": [], "aborted": []}
    core = engine.core
    add, abort = core.add_request, core.abort_request

    def spy_add(request: Any) -> None:
        calls["added"].append(request.request_id)
        add(request)

    def spy_abort(request_id: str) -> None:
        request = core.scheduler.requests.get(request_id)
        if request is not None:
            calls["aborted"].append((request_id, request.num_output_tokens))
        abort(request_id)

    monkeypatch.setattr(core, "add_request", spy_add)
    monkeypatch.setattr(core, "abort_request", spy_abort)
    return calls


def solo_greedy(prompt: str, max_tokens: int) -> str:
    """Reference text from the offline API, one request alone."""
    llm = LLM(loaded_model=default_model(), speculative_config=SPEC,
              max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS)
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens), use_tqdm=False
                        )[0].outputs[0].text


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def engine_idle(engine: AsyncEngine) -> bool:
    sched = engine.core.scheduler
    return not sched.has_unfinished_requests() and sched.kv_cache_usage() == 0.0


@pytest.mark.parametrize(("path", "raw", "param", "mentions", "status"),
                         [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid_request_is_refused(http: httpx.Client, engine_calls: dict[str, list[Any]],
                                    path: str, raw: bytes, param: str | None, mentions: str,
                                    status: int) -> None:
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert mentions in error["message"]
    if param is not None:
        assert param.split(".")[0] in error["message"]
    assert engine_calls["added"] == []  # refused before the engine saw it


def test_routing_errors_are_json(http: httpx.Client) -> None:
    missing = http.post("/v1/nothing", json={})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    for method, path in (("GET", C), ("GET", H), ("POST", "/health"), ("DELETE", "/v1/models")):
        response = http.request(method, path)
        assert response.status_code == 405, (method, path)
        assert response.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_past_the_context_is_400_streamed_or_not(http: httpx.Client,
                                                            engine: AsyncEngine,
                                                            stream: bool) -> None:
    response = http.post(C, json={"prompt": PROMPT, "max_tokens": 508, "stream": stream})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "at most 507" in error["message"]
    ok = http.post(C, json={"prompt": PROMPT, "max_tokens": 2, "stream": stream})
    assert ok.status_code == 200
    assert wait_until(lambda: engine_idle(engine))


def test_keep_alive_connection_survives_bad_input(server: ServerThread) -> None:
    """A 400 for a lone surrogate or a 10,000-deep body leaves the same keep-alive
    connection serving the next request (HTTP/1.1 over one raw socket)."""
    import socket

    def request(body: bytes) -> bytes:
        head = (f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        header, rest = data.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in header.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += sock.recv(65536)
        return header.split(b"\r\n")[0] + b" " + rest

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        assert request(b'{"prompt": "\\ud800"}').startswith(b"HTTP/1.1 400")
        deep = b'{"prompt": "hi", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
        assert request(deep).startswith(b"HTTP/1.1 400")
        reply = request(json.dumps({"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
                                   ).encode())
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_still_serves_after_invalid_requests(http: httpx.Client, engine: AsyncEngine) -> None:
    # Unknown fields are ignored (the documented policy), not refused.
    response = http.post(C, json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8,
                                  "temperature": 0, "user": "u1", "vendor_field": {"x": 1}})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == solo_greedy(PROMPT, 8)
    assert wait_until(lambda: engine_idle(engine))


def test_stream_disconnect_aborts_request(server: ServerThread, engine: AsyncEngine,
                                          engine_calls: dict[str, list[Any]],
                                          caplog: pytest.LogCaptureFixture) -> None:
    with (httpx.Client(base_url=server.base_url, timeout=30) as client,
          client.stream("POST", C, json={**LONG_RUN, "stream": True}) as response):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk read; leaving the block closes the connection
    assert wait_until(lambda: engine_idle(engine)), engine.core.scheduler.requests
    (added,) = engine_calls["added"]
    ((aborted, num_output),) = engine_calls["aborted"]
    assert aborted == added and num_output < LONG_RUN["max_tokens"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    # The abort is counted as a finished request with reason "abort", like vLLM.
    metrics = httpx.get(server.base_url + "/metrics").text
    counted = [line for line in metrics.splitlines()
               if line.startswith("specbudget:request_success_total{")
               and 'finished_reason="abort"' in line]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 1


def test_non_streaming_disconnect_aborts_request(server: ServerThread, engine: AsyncEngine,
                                                 engine_calls: dict[str, list[Any]],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with (httpx.Client(base_url=server.base_url, timeout=1.0) as client,
          pytest.raises(httpx.ReadTimeout)):
        client.post(C, json=LONG_RUN)  # gives up after 1 s and closes the connection
    assert wait_until(lambda: engine_idle(engine)), engine.core.scheduler.requests
    ((aborted, num_output),) = engine_calls["aborted"]
    assert aborted == engine_calls["added"][0] and num_output < LONG_RUN["max_tokens"]
    # The server noticed the disconnect itself; no handler failed on the way.
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def _sse_data(client: httpx.AsyncClient, payload: dict[str, Any]) -> list[str]:
    async with client.stream("POST", C, json=payload) as response:
        assert response.status_code == 200
        return [line[len("data: "):] async for line in response.aiter_lines()
                if line.startswith("data: ")]


async def _fault_scenario(base_url: str, engine: AsyncEngine, fault: threading.Event
                          ) -> tuple[list[str], httpx.Response]:
    """One streaming and one plain request in flight when the engine's step fails."""
    async with httpx.AsyncClient(base_url=base_url, timeout=20) as client:
        streamed = asyncio.create_task(_sse_data(client, {**LONG_RUN, "stream": True}))
        plain = asyncio.create_task(client.post(C, json=LONG_RUN))
        deadline = time.monotonic() + 20
        while len(engine.core.scheduler.running) < 2:
            assert time.monotonic() < deadline, "requests never started"
            await asyncio.sleep(0.01)
        fault.set()
        return await asyncio.wait_for(asyncio.gather(streamed, plain), timeout=20)


def test_engine_fault_fails_requests_and_then_503() -> None:
    engine = make_engine(max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS)
    fault = threading.Event()
    step = engine.core.step

    def failing_step() -> Any:
        if fault.is_set():
            raise RuntimeError("injected fault")
        return step()

    engine.core.step = failing_step  # type: ignore[method-assign]
    try:
        with serve(engine) as server:
            events, plain = asyncio.run(_fault_scenario(server.base_url, engine, fault))
            assert plain.status_code == 500
            assert plain.json()["error"]["code"] == "engine_dead"
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["type"] == "server_error" and "injected fault" in error["message"]
            assert not engine.is_alive
            with httpx.Client(base_url=server.base_url, timeout=5) as client:
                assert client.get("/health").status_code == 503
                for path, payload in ((C, {"prompt": PROMPT, "max_tokens": 4}),
                                      (H, {"messages": MSG, "stream": True})):
                    start = time.monotonic()
                    response = client.post(path, json=payload)
                    assert response.status_code == 503
                    assert response.json()["error"]["code"] == "engine_dead"
                    assert time.monotonic() - start < 2.0
    finally:
        engine.shutdown()
