"""ProcessEngine (the engine core in its own process) against the engine on a thread:
the same tokens, refusals that lose nothing else, stop strings that reach the engine.
The HTTP layer over it is tests/engine/test_server.py (both layouts); signals and
process deaths are tests/engine/test_serve_process.py (`specbudget serve`)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest

from engine.errors import EngineDeadError, EngineProcessDiedError
from engine.llm import LLM
from engine.process_engine import ProcessEngine
from scheduler import SamplingParams
from tests.server_helpers import SPEC, default_model, make_process_engine

pytestmark = pytest.mark.model  # loads the real default model (in a child process too)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours: red,",
           "Once upon a time"]


@pytest.fixture(scope="module")
def engine() -> Iterator[ProcessEngine]:
    eng = make_process_engine(max_model_len=256, kv_cache_memory_bytes=32 << 20)
    yield eng
    eng.shutdown()


async def collect(engine: ProcessEngine, request_id: str, prompt: list[int],
                  params: SamplingParams) -> tuple[list[int], str | None, str]:
    ids, reason, text = [], None, ""
    async for delta in engine.generate(request_id, prompt, params):
        ids += delta.new_token_ids
        text += delta.delta_text
        reason = delta.finish_reason
    return ids, reason, text


def settles(engine: ProcessEngine, timeout: float = 5.0) -> bool:
    """Whether the engine reports no request within `timeout` (its report follows the
    message that emptied it: a finish, an abort, a stop)."""
    deadline = time.monotonic() + timeout
    while engine.load() != (0, 0):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_greedy_tokens_equal_the_offline_engine(engine: ProcessEngine) -> None:
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]

    async def served() -> list[tuple[list[int], str | None, str]]:
        return await asyncio.gather(*(collect(engine, f"p{i}", p, params)
                                      for i, p in enumerate(prompts)))

    got = asyncio.run(served())
    llm = LLM(loaded_model=default_model(), speculative_config=SPEC, max_model_len=256,
              kv_cache_memory_bytes=32 << 20, dtype="float32")
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.close()
    assert [ids for ids, _, _ in got] == want
    assert all(reason == "length" for _, reason, _ in got)
    assert settles(engine)


def test_a_refused_request_names_why_and_the_others_are_served(engine: ProcessEngine) -> None:
    vocab = engine.tokenizer.vocab_size
    good = engine.tokenizer.encode(PROMPTS[0])

    async def both() -> list[object]:
        return await asyncio.gather(
            collect(engine, "bad", [1, vocab + 7], SamplingParams(max_tokens=4)),
            collect(engine, "good", good, SamplingParams(max_tokens=4, ignore_eos=True)),
            return_exceptions=True)

    bad, fine = asyncio.run(both())
    assert isinstance(bad, ValueError) and "prompt_token_ids" in str(bad)
    assert str(vocab) in str(bad)
    assert isinstance(fine, tuple) and len(fine[0]) == 4
    assert engine.is_alive and settles(engine)


def test_a_stop_string_ends_the_request_in_the_engine_too(engine: ProcessEngine) -> None:
    prompt = engine.tokenizer.encode(PROMPTS[2])
    _, _, full = asyncio.run(collect(engine, "full", prompt,
                                     SamplingParams(max_tokens=24, ignore_eos=True)))
    stop = full[len(full) // 3:len(full) // 3 + 3]
    assert stop.strip(), f"pick another prompt: {full!r}"
    _, reason, text = asyncio.run(collect(
        engine, "stopped", prompt, SamplingParams(max_tokens=230, ignore_eos=True,
                                                  stop=(stop,))))
    assert reason == "stop" and text == full[:full.find(stop)]
    # The engine was told: the request left its queues at once, not ~200 tokens later.
    assert settles(engine, timeout=1.0)
    assert engine.health()[1]["engine_restarts"] == 0


def test_an_engine_that_cannot_start_says_why_in_this_process() -> None:
    """A setting the engine refuses at start (a KV cache too small for one request) is
    a ValueError here, naming the setting, and leaves no process behind."""
    with pytest.raises(ValueError, match="kv-cache-memory"):
        make_process_engine(max_model_len=2048, kv_cache_memory_bytes=1 << 20)


def test_a_stopped_engine_refuses_new_requests_at_once() -> None:
    eng = make_process_engine(max_model_len=128, kv_cache_memory_bytes=16 << 20)
    pid = eng.pid
    eng.shutdown()
    assert not eng.is_alive and eng.health()[1]["engine_state"] == "stopped"
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(eng, "late", [1, 2], SamplingParams(max_tokens=2)))
    assert pid is not None
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(pid, 0)


def test_a_fault_handling_the_engines_output_fails_the_open_requests_and_restarts() -> None:
    """A bug on the API side of the pipe (here a metrics hook that raises) must not
    leave streams waiting forever: the engine process is stopped, its requests fail
    with the reason, and a new one serves."""
    eng = make_process_engine(max_model_len=128, kv_cache_memory_bytes=16 << 20)
    try:
        def broken(*_: object) -> None:
            raise RuntimeError("hook fault")

        eng.on_step.append(broken)
        with pytest.raises(EngineProcessDiedError, match="handling its output"):
            asyncio.run(collect(eng, "r", [1, 2, 3], SamplingParams(max_tokens=8)))
        eng.on_step.remove(broken)
        deadline = time.monotonic() + 120
        while not eng.is_alive:
            assert time.monotonic() < deadline, eng.health()
            time.sleep(0.1)
        ids, reason, _ = asyncio.run(collect(eng, "again", [1, 2, 3],
                                             SamplingParams(max_tokens=3, ignore_eos=True)))
        assert len(ids) == 3 and reason == "length"
        assert eng.health()[1]["engine_restarts"] == 1
    finally:
        eng.shutdown()


class _Channel:
    """One side of the engine core's pipes, in memory: `inbox` to read, `sent` written."""

    def __init__(self, inbox: list[bytes]) -> None:
        self.inbox, self.sent = inbox, []

    def poll(self, timeout: float | None = 0.0) -> bool:
        return bool(self.inbox)

    def recv_bytes(self) -> bytes:
        return self.inbox.pop(0)

    def send_bytes(self, buf: bytes) -> None:
        self.sent.append(buf)


def test_the_engine_core_freezes_its_loaded_heap() -> None:
    """Once loaded, the core freezes the heap (a full collection then scans only what
    serving makes: ~320,000 loaded objects cost 8-130 ms a collection, measured)."""
    import gc

    from engine.config import EngineConfig
    from engine.core_process import run_core
    from engine.ipc import Codec, EngineInputs, Ready

    codec = Codec()
    outputs = _Channel([])
    assert gc.get_freeze_count() == 0
    try:
        assert run_core(EngineConfig(max_model_len=128, kv_cache_memory_bytes=8 << 20,
                                     dtype="float32"),
                        _Channel([codec.encode(EngineInputs(shutdown=True))]), outputs) == 0
        assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()
    assert isinstance(codec.decode_outputs(outputs.sent[0]), Ready)
