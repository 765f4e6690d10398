"""Data-parallel replicas on a local Ray instance (one Ray start for this module).

Two replicas of the default model behind one front end: greedy outputs identical to a
single engine, requests routed to both, /health and /metrics per replica, and a
replica killed under load (32 concurrent streams through the real server and the
`openai` client) loses no request that had not started, and comes back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
import ray

from engine.config import EngineConfig
from engine.data_parallel import DataParallelEngine, _Replica
from engine.llm import LLM
from engine.local_server import serve_in_thread
from engine.routing import ReplicaState
from scheduler import SamplingParams

pytestmark = pytest.mark.model  # loads the real default model

# 4 running per replica: a killed replica holds requests mid-stream and requests waiting.
CONFIG = EngineConfig(max_num_seqs=4, max_model_len=512, kv_cache_memory_bytes=32 << 20)
PROMPTS = [[1, 504, 3303, 314, 2253 + i, 30] for i in range(8)]


@pytest.fixture(scope="module")
def dp() -> Iterator[DataParallelEngine]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    engine = DataParallelEngine(CONFIG, 2, model_name="m", num_threads=1)
    try:
        engine.wait_ready(timeout=300, every=True)
        yield engine
    finally:
        engine.shutdown()
        ray.shutdown()


async def _tokens(engine: DataParallelEngine, rid: str, prompt: list[int],
                  params: SamplingParams) -> list[int]:
    out: list[int] = []
    async for delta in engine.generate(rid, prompt, params):
        out.extend(delta.new_token_ids)
    return out


def test_two_replicas_match_one_engine(dp: DataParallelEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)

    async def run_all() -> list[list[int]]:
        return list(await asyncio.gather(*(_tokens(dp, f"g{i}", p, params)
                                           for i, p in enumerate(PROMPTS))))

    routed_before = [r.num_routed for r in dp.replicas]
    outputs = asyncio.run(run_all())
    single = LLM(**{k: getattr(CONFIG, k) for k in ("max_num_seqs", "max_model_len",
                                                    "kv_cache_memory_bytes")})
    expected = [o.outputs[0].token_ids for o in single.generate(PROMPTS, params,
                                                                use_tqdm=False)]
    assert outputs == expected
    routed = [r.num_routed - b for r, b in zip(dp.replicas, routed_before)]
    assert sum(routed) == len(PROMPTS) and min(routed) > 0, routed


def test_health_and_metrics_list_every_replica(dp: DataParallelEngine) -> None:
    with serve_in_thread(dp, "m") as server:
        health = httpx.get(f"{server.base_url}/health")
        metrics = httpx.get(f"{server.base_url}/metrics").text
    assert health.status_code == 200
    replicas = health.json()["replicas"]
    assert [r["replica"] for r in replicas] == [0, 1]
    assert {r["state"] for r in replicas} == {"ready"}
    assert len({r["pid"] for r in replicas}) == 2
    for index in ("0", "1"):
        assert f'specbudget:replica_ready{{replica="{index}",state="ready"}} 1.0' in metrics
        running = [line for line in metrics.splitlines()
                   if line.startswith("specbudget:num_requests_running{")]
        assert any(f'replica="{index}"' in line for line in running), running


def test_killed_replica_loses_no_unstarted_request_and_returns(
        dp: DataParallelEngine) -> None:
    victim = dp.replicas[0]
    old_pid = victim.info["pid"]
    kill_time: list[float] = []
    with serve_in_thread(dp, "m") as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        results: dict[int, tuple[str, float | None]] = {}
        started: list[int] = []

        def one(i: int) -> None:
            first: float | None = None
            try:
                stream = client.completions.create(
                    model="m", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=48,
                    temperature=0.0, stream=True, extra_body={"ignore_eos": True})
                for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].text:
                        first = time.monotonic()
                        started.append(i)
                results[i] = ("ok", first)
            except openai.APIError:
                results[i] = ("error", first)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(started) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)  # kill it once both replicas stream, with more queued
        os.kill(old_pid, signal.SIGKILL)
        kill_time.append(time.monotonic())
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(results) == 32
    failed = [first for status, first in results.values() if status == "error"]
    # Only a request that had streamed tokens from the dead replica may fail.
    assert all(first is not None and first < kill_time[0] + 2.0 for first in failed), failed
    # Both paths ran: streams under way ended with an error, queued ones were re-sent.
    assert failed and dp.num_resent > 0, (len(failed), dp.num_resent)
    deadline = time.monotonic() + 300
    while not (victim.load.state is ReplicaState.READY and victim.info["pid"] != old_pid):
        assert time.monotonic() < deadline, victim.describe()
        time.sleep(0.2)


def test_engine_fault_in_a_replica_is_replaced(dp: DataParallelEngine) -> None:
    """A replica whose engine loop faults (here: a message it cannot decode, its
    process alive) says why, is killed and restarted by Ray; meanwhile the other
    replica serves every request."""
    victim, other = dp.replicas[1], dp.replicas[0]
    _wait_ready(victim)
    old_pid = victim.info["pid"]
    victim._push(b"\xc1")  # never valid msgpack
    seen_down = False
    deadline = time.monotonic() + 300
    while not (victim.load.state is ReplicaState.READY and victim.info["pid"] != old_pid):
        assert time.monotonic() < deadline, victim.describe()
        if victim.load.state is not ReplicaState.READY and not seen_down:
            seen_down = True
            assert "DecodeError" in (victim.error or ""), victim.error
            assert dp.health()[0]  # still serving through the other replica
            routed = other.num_routed
            params = SamplingParams(max_tokens=4, temperature=0.0)
            asyncio.run(_tokens(dp, "during-fault", PROMPTS[0], params))
            assert other.num_routed == routed + 1
        time.sleep(0.05)
    assert seen_down


def test_a_fault_handling_a_replicas_output_replaces_it_and_loses_nothing(
        dp: DataParallelEngine) -> None:
    """A fault on the front end's side (here a metrics hook that raises once) leaves
    that replica without a reader: it is killed and restarted, and a non-streamed
    request it held is sent to the other replica and returns what one engine does."""
    for replica in dp.replicas:
        _wait_ready(replica)
    pids = [r.info["pid"] for r in dp.replicas]
    raised: list[int] = []

    def hook_for(index: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            if not raised:
                raised.append(index)
                raise RuntimeError("injected fault in the front end")
        return hook

    hooks = [hook_for(r.load.index) for r in dp.replicas]
    for replica, hook in zip(dp.replicas, hooks):
        replica.client.on_step.append(hook)
    resent = dp.num_resent
    params = SamplingParams(max_tokens=12, temperature=0.0)

    async def buffered() -> list[int]:
        out: list[int] = []
        async for delta in dp.generate("hooked", PROMPTS[2], params, buffered=True):
            out.extend(delta.new_token_ids)
        return out

    try:
        tokens = asyncio.run(buffered())
    finally:
        for replica, hook in zip(dp.replicas, hooks):
            replica.client.on_step.remove(hook)
    assert raised and dp.num_resent == resent + 1
    victim = dp.replicas[raised[0]]
    assert "failed handling" in (victim.error or ""), victim.describe()
    single = asyncio.run(_tokens(dp, "again", PROMPTS[2], params))
    assert tokens == single
    deadline = time.monotonic() + 300
    while not (victim.load.state is ReplicaState.READY
               and victim.info["pid"] != pids[raised[0]]):
        assert time.monotonic() < deadline, victim.describe()
        time.sleep(0.1)


def test_a_stream_left_early_is_aborted_in_its_replica(dp: DataParallelEngine) -> None:
    """A client that leaves after its first delta (a disconnect) stops its request in
    the replica at once: the replica's next step reports nothing running."""
    for replica in dp.replicas:
        _wait_ready(replica)

    async def leave_early() -> None:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        stream = dp.generate("leaver", PROMPTS[1], params)
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]

    before = [r.client.snapshot.stats.num_steps for r in dp.replicas]
    asyncio.run(leave_early())
    deadline = time.monotonic() + 30
    while any(r.client.num_open or r.client.snapshot.running for r in dp.replicas):
        assert time.monotonic() < deadline, [r.describe() for r in dp.replicas]
        time.sleep(0.05)
    steps = [r.client.snapshot.stats.num_steps - b for r, b in zip(dp.replicas, before)]
    assert max(steps) < 100, steps  # stopped long before its 400 tokens


def test_settings_a_replica_refuses_raise_at_start(dp: DataParallelEngine) -> None:
    """An engine that cannot hold one request is refused with the engine's own
    words, once, not restarted forever."""
    tiny = EngineConfig(max_num_seqs=4, max_model_len=512, num_kv_blocks=2)
    with pytest.raises(ValueError, match="max_model_len"):
        refused = DataParallelEngine(tiny, 2, num_threads=1)
        try:
            refused.wait_ready(timeout=120)
        finally:
            refused.shutdown()


def _wait_ready(replica: _Replica) -> None:
    deadline = time.monotonic() + 300
    while replica.load.state is not ReplicaState.READY:
        assert time.monotonic() < deadline, replica.describe()
        time.sleep(0.1)


def test_a_refused_request_gets_the_replicas_own_error(dp: DataParallelEngine) -> None:
    """A refusal comes back as the engine's ValueError naming the limit, not Ray's
    wrapper with a remote traceback; nothing is re-sent."""
    resent = dp.num_resent
    with pytest.raises(ValueError, match="max_model_len=512") as info:
        asyncio.run(_tokens(dp, "too-long", list(range(3, 600)), SamplingParams()))
    assert "Traceback" not in str(info.value) and type(info.value) is ValueError
    assert dp.num_resent == resent


def test_killed_replica_loses_no_non_streamed_request(dp: DataParallelEngine) -> None:
    """Non-streamed requests have shown the client nothing: a replica killed midway
    costs a re-send, and greedy requests return exactly what one engine returns
    (before buffering, 8 of 16 got an error)."""
    for replica in dp.replicas:  # the previous test's victim must be back
        _wait_ready(replica)
    victim = dp.replicas[1]
    old_pid = victim.info["pid"]
    resent_before = dp.num_resent
    with serve_in_thread(dp, "m") as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        results: dict[int, list[int] | str] = {}

        def one(i: int) -> None:
            try:
                out = client.completions.create(
                    model="m", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=40,
                    temperature=0.0, extra_body={"ignore_eos": True})
                results[i] = out.choices[0].text  # type: ignore[assignment]
            except openai.APIError as err:
                results[i] = f"error: {err}"

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while victim.client.snapshot.running == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # midway through its requests
        os.kill(old_pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=300)
    assert not any(isinstance(r, str) and r.startswith("error") for r in results.values()), \
        results
    assert dp.num_resent > resent_before
    single = LLM(**{k: getattr(CONFIG, k) for k in ("max_num_seqs", "max_model_len",
                                                    "kv_cache_memory_bytes")})
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].text for o in single.generate(PROMPTS, params, use_tqdm=False)]
    assert all(results[i] == expected[i % len(PROMPTS)] for i in range(16))
