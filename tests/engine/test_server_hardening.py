"""The server under hostile load : bodies too large, prompts too long, the
event loop kept free while tokenising, stop strings inside accepted drafts, logprob
bytes, a runner fault tied to one request, aborts before the engine picks a request
up. Real uvicorn on 127.0.0.1, the default model."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from engine.async_engine import AsyncEngine
from tests.server_helpers import MODEL_NAME, ServerThread, make_engine, serve

pytestmark = pytest.mark.model  # loads the real default model

C, H = "/v1/completions", "/v1/chat/completions"
LIST_PROMPT = ("Copy the list exactly: apple, banana, cherry, date, elderberry, fig, grape. "
               "Copy: apple, banana, cherry,")
GROUNDED = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the"


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    eng = make_engine(max_model_len=256, num_kv_blocks=64)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: AsyncEngine) -> Iterator[ServerThread]:
    with serve(engine) as thread:
        yield thread


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def idle(engine: AsyncEngine) -> bool:
    deadline = time.monotonic() + 10
    while engine.core.has_unfinished_requests() or engine.core.scheduler.kv_cache_usage():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---- body size, prompt size, tokenising off the event loop -------------------


def test_body_over_the_limit_is_413_before_it_is_read(http: httpx.Client) -> None:
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    response = http.post(C, content=big, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and str(4 << 20) in error["message"]


def test_chunked_body_over_the_limit_is_413(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"a" * (64 << 10)
        yield b'"}'

    response = http.post(C, content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413


def test_prompt_that_cannot_fit_is_refused_without_tokenising(
        http: httpx.Client, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode",
                        lambda text, *a: calls.append(len(text)) or encode(text, *a))
    for path, payload in ((C, {"prompt": "word " * 200_000}),
                          (H, {"messages": [{"role": "user", "content": "word " * 200_000}]})):
        response = http.post(path, json=payload)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "context_length_exceeded"
    assert calls == []


def test_health_answers_while_a_prompt_is_being_tokenised(
        server: ServerThread, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenising runs on a worker thread: /health answers while it is stuck."""
    inside, release = threading.Event(), threading.Event()
    encode = engine.tokenizer.encode

    def slow_encode(text: str, *args: Any) -> list[int]:
        inside.set()
        assert release.wait(30)
        return encode(text, *args)

    monkeypatch.setattr(engine.tokenizer, "encode", slow_encode)

    async def scenario() -> tuple[int, int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            slow = asyncio.create_task(client.post(C, json={"prompt": "hi", "max_tokens": 2}))
            while not inside.is_set():
                await asyncio.sleep(0.01)
            health = await client.get("/health")
            assert not slow.done()  # the completion is still stuck in the tokenizer
            release.set()
            return health.status_code, (await slow).status_code

    assert asyncio.run(scenario()) == (200, 200)


# ---- a stop string inside accepted drafts -------------------------------------


def test_stop_inside_accepted_drafts_matches_speculation_off(server: ServerThread) -> None:
    """ngram drafts " elderberry, fig, grape" from the prompt and the model accepts it
    in one step; with stop " fig" the text, usage, logprob tokens and text_offset equal
    speculation off's (logprob values agree to float noise: batch shapes differ)."""
    off = make_engine(max_model_len=256, num_kv_blocks=64, speculative_config=None)
    request = {"model": MODEL_NAME, "prompt": LIST_PROMPT, "max_tokens": 40,
               "temperature": 0, "stop": [" fig"], "logprobs": 1}
    try:
        with serve(off) as off_server:
            got = httpx.post(server.base_url + C, json=request, timeout=60).json()
            want = httpx.post(off_server.base_url + C, json=request, timeout=60).json()
    finally:
        off.shutdown()
    (g,), (w,) = got["choices"], want["choices"]
    assert g["text"] == w["text"] == " date, elderberry,"
    assert g["finish_reason"] == w["finish_reason"] == "stop"
    assert got["usage"] == want["usage"]
    for key in ("tokens", "text_offset"):
        assert g["logprobs"][key] == w["logprobs"][key], key
    assert g["logprobs"]["token_logprobs"] == pytest.approx(w["logprobs"]["token_logprobs"],
                                                            abs=1e-4)
    assert len(g["logprobs"]["tokens"]) == got["usage"]["completion_tokens"]
    assert g["logprobs"]["text_offset"][-1] == len(g["text"])  # the token that stopped it


# ---- logprob bytes -----------------------------------------------------------


def test_chat_logprob_bytes_rebuild_emoji(server: ServerThread) -> None:
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=15, logprobs=True, top_logprobs=1,
        messages=[{"role": "user", "content": "Repeat this emoji three times: 😀"}])
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    joined = b"".join(bytes(entry.bytes or []) for entry in choice.logprobs.content)
    assert joined.decode() == choice.message.content
    assert any(ord(c) > 0xFFFF for c in choice.message.content)  # really an emoji


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_name_partial_characters_by_their_bytes(
        server: ServerThread, stream: bool) -> None:
    """Tokens holding part of a UTF-8 character are "bytes:\\xNN" (as vLLM), so the top
    candidates stay distinct keys at the requested size, the sampled token's logprob is
    its own, and every text_offset lies inside the text."""
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    request = dict(model=MODEL_NAME, prompt="😀😃😄😁😆😅😂🤣", max_tokens=6, temperature=0,
                   logprobs=5, extra_body={"ignore_eos": True})
    if stream:
        tokens, top, token_lps, offsets, text = [], [], [], [], ""
        for chunk in client.completions.create(stream=True, **request):  # type: ignore[call-overload]
            choice = chunk.choices[0]
            text += choice.text
            if choice.logprobs:
                tokens += choice.logprobs.tokens
                top += choice.logprobs.top_logprobs
                token_lps += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    else:
        choice = client.completions.create(**request).choices[0]  # type: ignore[call-overload]
        assert choice.logprobs is not None
        tokens, top = choice.logprobs.tokens, choice.logprobs.top_logprobs
        token_lps, offsets = choice.logprobs.token_logprobs, choice.logprobs.text_offset
        text = choice.text
    assert len(tokens) == 6 and any(t.startswith("bytes:\\x") for t in tokens), tokens
    assert all(len(candidates) == 5 for candidates in top), top
    for token, lp, candidates in zip(tokens, token_lps, top, strict=True):
        if token in candidates:  # greedy: the sampled token is the best candidate
            assert candidates[token] == lp == max(candidates.values())
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)


# ---- a runner fault tied to one request --------------------------------------

MARK = 4242  # a prompt starting with this token id makes the runner fail


def test_runner_fault_fails_only_its_request(engine: AsyncEngine, server: ServerThread,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    runner = engine.core.runner
    execute = runner.execute
    bad: set[str] = set()

    def faulty(out: Any) -> Any:
        bad.update(new.req_id for new in out.scheduled_new_reqs
                   if new.prompt_token_ids[0] == MARK)
        if bad & set(out.num_scheduled_tokens):
            raise ValueError("injected fault")
        return execute(out)

    monkeypatch.setattr(runner, "execute", faulty)
    good = {"prompt": GROUNDED, "max_tokens": 8, "temperature": 0}

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            return list(await asyncio.gather(
                client.post(C, json=good), client.post(C, json={**good, "prompt": [MARK, 5]}),
                client.post(C, json=good), client.post(C, json={**good, "stream": True})))

    first, failed, third, streamed = asyncio.run(scenario())
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == "request_failed"
    assert first.status_code == third.status_code == streamed.status_code == 200
    assert first.json()["choices"][0]["text"] == third.json()["choices"][0]["text"]
    assert "data: [DONE]" in streamed.text and '"error"' not in streamed.text
    assert engine.is_alive and httpx.get(server.base_url + "/health").status_code == 200
    assert idle(engine)
    monkeypatch.undo()
    again = httpx.post(server.base_url + C, json=good, timeout=60)
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


# ---- an abort before the engine picked the request up is counted -------------


def test_abort_before_pickup_counts_as_abort(engine: AsyncEngine,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import CollectorRegistry

    from engine.server import wire_engine_metrics
    from scheduler import SamplingParams

    registry = CollectorRegistry()
    unwire = wire_engine_metrics(engine, registry, "m")
    gate = threading.Event()
    apply = engine._apply_inputs

    def gated() -> None:
        gate.wait(10)
        apply()

    monkeypatch.setattr(engine, "_apply_inputs", gated)

    async def leave_early() -> None:
        stream = engine.generate("early", [5, 6, 7], SamplingParams(max_tokens=4))
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)  # the add is queued; the engine thread is held
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()

    try:
        asyncio.run(leave_early())
        gate.set()
        assert idle(engine)
        deadline = time.monotonic() + 5
        while registry.get_sample_value("specbudget:request_success_total",
                                        {"model_name": "m", "finished_reason": "abort"}) != 1:
            assert time.monotonic() < deadline, "the abort was never counted"
            time.sleep(0.02)
    finally:
        gate.set()
        unwire()
