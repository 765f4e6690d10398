"""The OpenAI-compatible server end to end: real uvicorn on 127.0.0.1, the official
`openai` client, the default model with n-gram speculation (K=3)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from engine.serving import ServingEngine
from tests.server_helpers import (
    MODEL_NAME,
    ServerThread,
    make_engine,
    make_process_engine,
    serve,
)

pytestmark = pytest.mark.model  # loads the real default model

PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    "Once upon a time, a curious robot",
    "def add(a, b):\n    return",
    "The quick brown fox jumps over the",
    "Three tips for staying healthy are",
    "Copy: red, green, blue. Copy: red,",
    "The best way to learn a new language is",
]
MAX_TOKENS = 8
CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request: pytest.FixtureRequest) -> Iterator[ServingEngine]:
    """Both layouts: the engine on a thread of the server's process, and in its own
    process (what `specbudget serve` runs)."""
    eng = make_engine() if request.param == "thread" else make_process_engine()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: ServingEngine) -> Iterator[ServerThread]:
    with serve(engine) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server: ServerThread) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                  timeout=60)


def complete(client: OpenAI, prompt: str, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    kwargs.setdefault("temperature", 0.0)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, **kwargs)


def chat(client: OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    kwargs.setdefault("temperature", 0.0)
    return client.chat.completions.create(model=MODEL_NAME, messages=CHAT, **kwargs)


def streamed_text(chunks: Any, chat_api: bool) -> tuple[dict[int, str], dict[int, str]]:
    """Text and finish reason per choice index, joined from stream chunks."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = (choice.delta.content if chat_api else choice.text) or ""
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons


def test_completion(client: OpenAI, engine: ServingEngine) -> None:
    out = complete(client, PROMPTS[0])
    assert out.object == "text_completion" and out.model == MODEL_NAME
    assert out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert choice.text and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(engine.tokenizer.encode(PROMPTS[0]))
    assert out.usage.completion_tokens == MAX_TOKENS
    assert out.usage.total_tokens == out.usage.prompt_tokens + MAX_TOKENS


def test_prompt_forms_agree(client: OpenAI, engine: ServingEngine) -> None:
    """A prompt as text, [text], token ids or [token ids] is the same request."""
    ids = engine.tokenizer.encode(PROMPTS[0])
    texts = {complete(client, form).choices[0].text
             for form in (PROMPTS[0], [PROMPTS[0]], ids, [ids])}
    assert len(texts) == 1


def test_chat(client: OpenAI) -> None:
    out = chat(client)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 0 < out.usage.completion_tokens <= MAX_TOKENS


@pytest.mark.parametrize("chat_api", [False, True], ids=["completions", "chat"])
def test_streamed_equals_non_streamed(client: OpenAI, chat_api: bool) -> None:
    call = (lambda **kw: chat(client, **kw)) if chat_api else (
        lambda **kw: complete(client, PROMPTS[2], **kw))
    whole = call()
    texts, reasons = streamed_text(call(stream=True), chat_api)
    expected = whole.choices[0].message.content if chat_api else whole.choices[0].text
    assert texts == {0: expected}
    assert reasons == {0: whole.choices[0].finish_reason}


def test_n_choices(client: OpenAI) -> None:
    out = complete(client, PROMPTS[0], n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text  # greedy: the same twice
    assert out.usage.completion_tokens == 2 * MAX_TOKENS
    texts, _ = streamed_text(chat(client, n=2, stream=True), chat_api=True)
    assert sorted(texts) == [0, 1] and texts[0] == texts[1]


def test_stop_string_cuts_text(client: OpenAI) -> None:
    full = complete(client, PROMPTS[5], max_tokens=16).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {full!r}"
    expected = full[:full.find(stop)]
    out = complete(client, PROMPTS[5], max_tokens=16, stop=[stop, "never-appears"])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    texts, reasons = streamed_text(
        complete(client, PROMPTS[5], max_tokens=16, stop=stop, stream=True), chat_api=False)
    assert texts == {0: expected} and reasons == {0: "stop"}


def test_seed_reproducible(client: OpenAI) -> None:
    def sample(seed: int, n: int = 1) -> list[str]:
        out = complete(client, PROMPTS[2], temperature=0.8, seed=seed, n=n)
        return [c.text for c in out.choices]

    assert sample(1234) == sample(1234)
    # Choice i of a seeded request is seeded seed + i.
    assert sample(1234, n=2) == sample(1234) + sample(1235)


def test_completion_logprobs(client: OpenAI) -> None:
    out = complete(client, PROMPTS[1], logprobs=2)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens).startswith(out.choices[0].text)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2  # two ids can decode to the same text
        assert logprob <= 0 and logprob == pytest.approx(max(top.values()))  # greedy


def test_chat_logprobs(client: OpenAI) -> None:
    out = chat(client, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(out.choices[0].message.content)
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


@pytest.mark.parametrize("chat_api", [False, True], ids=["completions", "chat"])
def test_include_usage(client: OpenAI, chat_api: bool) -> None:
    options = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = list(chat(client, **options) if chat_api else complete(client, PROMPTS[0],
                                                                     **options))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens <= MAX_TOKENS
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in body)


def test_models_health_metrics(client: OpenAI, server: ServerThread) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(server.base_url + "/health").status_code == 200
    metrics = httpx.get(server.base_url + "/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "specbudget:generation_tokens_total" in metrics.text


async def _stream_one(client: AsyncOpenAI, prompt: str) -> str:
    stream = await client.completions.create(model=MODEL_NAME, prompt=prompt,
                                             max_tokens=MAX_TOKENS, temperature=0.0,
                                             stream=True)
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


async def _load_rounds(base_url: str, rounds: int, clients: int) -> list[list[str]]:
    async with AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:
        results = []
        for _ in range(rounds):
            results.append(await asyncio.gather(
                *(_stream_one(client, PROMPTS[i % len(PROMPTS)]) for i in range(clients))))
        return results


def test_concurrent_streams_match_solo(client: OpenAI, server: ServerThread,
                                       engine: ServingEngine) -> None:
    """32 concurrent streaming clients, three rounds: every greedy output equals the
    same prompt served alone, and the KV cache is empty afterwards."""
    solo = [complete(client, p).choices[0].text for p in PROMPTS]
    assert all(solo)
    running: list[int] = []
    hooks = engine.on_step
    hooks.append(lambda core, *_: running.append(len(core.scheduler.running)))
    try:
        rounds = asyncio.run(_load_rounds(server.base_url, rounds=3, clients=32))
    finally:
        hooks.pop()
    assert max(running) >= 16  # the clients really shared steps
    for texts in rounds:
        assert texts == [solo[i % len(PROMPTS)] for i in range(32)]
    assert wait_idle(server.base_url, engine)


def kv_usage(base_url: str) -> float:
    """The KV cache usage the engine last reported, as an operator reads it."""
    text = httpx.get(base_url + "/metrics").text
    (line,) = [x for x in text.splitlines() if x.startswith("specbudget:kv_cache_usage_perc")]
    return float(line.rsplit(" ", 1)[1])


def wait_idle(base_url: str, engine: ServingEngine, timeout: float = 5.0) -> bool:
    """Whether the engine reports no request and no KV block in use within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kv_usage(base_url) == 0.0 and engine.load() == (0, 0):
            return True
        time.sleep(0.05)
    return False


def test_a_stream_left_early_is_aborted_and_frees_its_blocks(server: ServerThread,
                                                              engine: ServingEngine) -> None:
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60, json={
            "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True,
            "model": MODEL_NAME}) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert kv_usage(server.base_url) > 0.0 or engine.load() != (0, 0)
    assert wait_idle(server.base_url, engine)
