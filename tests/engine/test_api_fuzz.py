"""Property-based fuzzing of the OpenAI API (what keeps the API's refusals right).

The request bodies come from the JSON schemas the app itself publishes in its OpenAPI
document (hypothesis-jsonschema), plus bodies whose fields hold arbitrary JSON and raw
bytes that are not JSON at all. Against a real uvicorn server and a real engine (a
tiny random Llama with the default model's tokenizer, so generation costs nothing),
every response must be: no 5xx; every 4xx an OpenAI error object; every 200 a
well-formed body or SSE stream ending in [DONE]. Afterwards the engine is alive,
holds no KV block, and a known greedy request gives the same text as before.

CI runs the derandomized `ci` profile (bounded examples); HYPOTHESIS_PROFILE=dev runs
many more.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from safetensors.torch import save_file

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from runner.model_prep import resolve_model
from runner.models.llama import LlamaConfig, LlamaForCausalLM
from spec_decode import SpeculativeConfig
from tests.server_helpers import ServerThread, serve

pytestmark = pytest.mark.model  # a real server; the last test loads the real model

MAX_MODEL_LEN = 64
NAME = "tiny"
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
KNOWN = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def write_tiny_model(path: Path) -> Path:
    """A 2-layer Llama with random weights, saved as an HF directory beside the default
    model's tokenizer: loaded through the same loader as any checkpoint."""
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.05)
    save_file({name: p.detach().contiguous() for name, p in model.named_parameters()},
              str(path / "model.safetensors"))
    source = resolve_model(None)
    hf_config = json.loads((source / "config.json").read_text())
    hf_config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=512, rope_theta=10000.0)
    (path / "config.json").write_text(json.dumps(hf_config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    return path


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncEngine]:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    eng = AsyncEngine(EngineConfig(
        model=str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64,
        num_kv_blocks=64, speculative_config=SpeculativeConfig("ngram", 3)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: AsyncEngine) -> Iterator[ServerThread]:
    with serve(engine, NAME) as thread:
        yield thread


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def schemas(http: httpx.Client) -> dict[str, dict[str, Any]]:
    """The request schemas as the running server publishes them."""
    doc = http.get("/openapi.json").json()
    return {name: doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            ["schema"] for name, path in PATHS.items()}


def check(response: httpx.Response, stream: bool) -> None:
    """The properties every response must have."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["message"] and error["type"] == "invalid_request_error"
        return
    assert response.status_code == 200
    if not stream:
        assert response.json()["choices"]
        return
    events = [line.removeprefix("data: ") for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        assert "error" not in json.loads(event), event


def post(http: httpx.Client, path: str, body: Any) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    stream = isinstance(body, dict) and body.get("stream") is True
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    check(response, stream)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)

FUZZ = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@pytest.mark.parametrize("endpoint", list(PATHS))
@FUZZ
@given(data=st.data())
def test_schema_valid_bodies(http: httpx.Client, schemas: dict[str, dict[str, Any]],
                             endpoint: str, data: st.DataObject) -> None:
    body = data.draw(from_schema(schemas[endpoint]))
    # The schema allows the model to be anything: half the time, name the served one.
    if data.draw(st.booleans()):
        body["model"] = NAME
    post(http, PATHS[endpoint], body)


# Fields the server refuses whenever they would change the result (protocol.py's policy).
UNSUPPORTED = {"logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "echo", "suffix",
               "best_of", "tools", "tool_choice", "functions", "function_call",
               "response_format", "model"}


def servable(schema: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The published schema narrowed to what can succeed: supported fields only, the
    prompt required, a few tokens each (so most bodies reach the engine and stream)."""
    properties = {name: spec for name, spec in schema["properties"].items()
                  if name not in UNSUPPORTED}
    for name in ("max_tokens", "max_completion_tokens"):
        if name in properties:
            properties[name] = {"type": "integer", "minimum": 1, "maximum": 6}
    if "min_tokens" in properties:  # at most max_tokens' smallest value
        properties["min_tokens"] = {"type": "integer", "minimum": 0, "maximum": 1}
    required = ["prompt"] if endpoint == "completions" else ["messages"]
    return {**schema, "properties": properties, "required": required}


@pytest.mark.parametrize("endpoint", list(PATHS))
@settings(FUZZ, max_examples=settings.default.max_examples // 2)  # each one generates
@given(data=st.data())
def test_servable_bodies(http: httpx.Client, schemas: dict[str, dict[str, Any]],
                         endpoint: str, data: st.DataObject) -> None:
    body = data.draw(from_schema(servable(schemas[endpoint], endpoint)))
    body["stream"] = data.draw(st.booleans())  # half the bodies stream
    if not body["stream"]:
        body.pop("stream_options", None)
    post(http, PATHS[endpoint], body)


@pytest.mark.parametrize("endpoint", list(PATHS))
@FUZZ
@given(data=st.data())
def test_fields_holding_arbitrary_json(http: httpx.Client, schemas: dict[str, dict[str, Any]],
                                       endpoint: str, data: st.DataObject) -> None:
    names = sorted(schemas[endpoint]["properties"])
    body = data.draw(st.dictionaries(st.sampled_from(names), JSON, max_size=6))
    base = {"prompt": "hi"} if endpoint == "completions" else {
        "messages": [{"role": "user", "content": "hi"}]}
    post(http, PATHS[endpoint], {**base, "max_tokens": 4, **body})


INTEGER_FIELDS = ("max_tokens", "n", "seed", "top_k", "logprobs", "priority", "min_tokens")


@FUZZ
@given(name=st.sampled_from(INTEGER_FIELDS), value=st.booleans())
def test_booleans_are_never_integers(http: httpx.Client, name: str, value: bool) -> None:
    response = http.post(PATHS["completions"], json={"prompt": "hi", "max_tokens": 2,
                                                     name: value})
    assert response.status_code == 400, (name, response.text)
    assert response.json()["error"]["param"] == name


@FUZZ
@given(prompt=st.text(st.characters(min_codepoint=0x80, max_codepoint=0x1FAFF,
                                    categories=("L", "S")), min_size=1, max_size=6),
       top=st.integers(1, 5), stream=st.booleans())
def test_completion_logprobs_keep_their_size_and_offsets(http: httpx.Client, prompt: str,
                                                         top: int, stream: bool) -> None:
    """Random weights pick tokens holding parts of characters often: every position
    still names `top` distinct candidates, and every text_offset lies in the text."""
    body = {"prompt": prompt, "max_tokens": 4, "logprobs": top, "temperature": 1.0,
            "seed": 0, "ignore_eos": True, "stream": stream}
    response = http.post(PATHS["completions"], json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
    else:
        choices = response.json()["choices"]
    text = "".join(c["text"] for c in choices)
    tops = [t for c in choices if c["logprobs"] for t in c["logprobs"]["top_logprobs"]]
    offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert len(tops) == 4 and all(len(t) == top for t in tops), tops
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)


@FUZZ
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_bodies_that_are_not_json(http: httpx.Client, raw: bytes) -> None:
    post(http, PATHS["completions"], raw)


def test_engine_still_serves_after_the_fuzzing(http: httpx.Client, engine: AsyncEngine,
                                               server: ServerThread) -> None:
    """Runs last in this module (pytest keeps file order): same text as a fresh
    engine gives, the engine alive, every KV block back once idle."""
    import time

    first = http.post(PATHS["completions"], json=KNOWN).json()["choices"][0]["text"]
    deadline = time.monotonic() + 30
    while engine.core.has_unfinished_requests():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert engine.is_alive and engine.core.scheduler.kv_cache_usage() == 0.0
    fresh = AsyncEngine(engine.config)
    try:
        with serve(fresh, NAME) as other:
            want = httpx.post(other.base_url + PATHS["completions"], json=KNOWN, timeout=60)
    finally:
        fresh.shutdown()
    assert first == want.json()["choices"][0]["text"]
