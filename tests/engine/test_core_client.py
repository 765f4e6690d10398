"""CoreClient, the API side of an engine core in another process: a step's metrics
are counted before any caller gets the step's tokens, so a client that has its answer
and reads /metrics sees it counted (CI once read /metrics a beat too early)."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.config import EngineConfig
from engine.core_client import CoreClient
from engine.ipc import Snapshot, StepOutputs, TokenUpdate
from engine.output import LatencySample, RequestDelta
from engine.serving import DeltaStream
from engine.tokenizer import Tokenizer
from runner.model_prep import resolve_model
from scheduler import SamplingParams
from scheduler.stats import SchedulerStats


class RecordingLoop:
    """Stands in for a caller's event loop: logs when the client hands it deltas."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        self.log.append("delivered")
        fn(*args)


def finished_step(request_id: str, token: int) -> StepOutputs:
    update = TokenUpdate(request_id, [token], True, "length", [], None)
    return StepOutputs([update], [], Snapshot(0, 0, 0.0, {}, SchedulerStats()))


def test_a_step_is_counted_before_its_caller_gets_it() -> None:
    tokenizer = Tokenizer.from_dir(resolve_model(None))
    client = CoreClient(EngineConfig(), tokenizer, send=lambda _: None, gate=lambda: None)
    log: list[str] = []

    def hook(_view: Any, deltas: list[RequestDelta],
             _latency: dict[str, LatencySample]) -> None:
        log.append(f"counted {sum(len(d.new_token_ids) for d in deltas)}")

    client.on_step.append(hook)
    queue: asyncio.Queue[Any] = asyncio.Queue()
    stream = DeltaStream(RecordingLoop(log), queue)  # type: ignore[arg-type]
    client._streams["r"] = stream  # what `generate` registers before it sends
    client.processor.add("r", 3, SamplingParams(max_tokens=1))
    client.on_outputs(finished_step("r", 42))
    assert log == ["counted 1", "delivered"]
    delta = queue.get_nowait()
    assert delta.new_token_ids == [42] and delta.finished
