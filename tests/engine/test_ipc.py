"""The API <-> engine-process messages (engine/ipc.py): round trips, compactness,
refusal of malformed input. Fast: no model, no process."""

from __future__ import annotations

import msgspec
import pytest

from engine.ipc import (
    Codec,
    EngineInputs,
    Failed,
    NewRequest,
    Ready,
    Snapshot,
    StepOutputs,
    TokenUpdate,
)
from scheduler import EngineCoreOutput, SamplingParams
from scheduler.stats import SchedulerStats


def stats() -> SchedulerStats:
    out = SchedulerStats(num_steps=7, num_preemptions=1)
    out.spec.record_many([3, 3], [2, 0])
    out.goodput.chosen_k = [4, 0, 2]
    out.peak_pass_rows["target"] = 40
    return out


def step(num_requests: int, tokens_each: int = 2) -> StepOutputs:
    outputs = [TokenUpdate.of(EngineCoreOutput(f"cmpl-{i:032d}-0", list(range(tokens_each)),
                                               False, None)) for i in range(num_requests)]
    return StepOutputs(outputs, [], Snapshot(num_requests, 0, 0.25, {"target": 16}, stats()))


def test_inputs_round_trip_with_every_sampling_field() -> None:
    codec = Codec()
    params = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1,
                            seed=-3, stop_token_ids=(2, 7), ignore_eos=True, min_tokens=1,
                            logprobs=3, stop=("\n\n", "END"))
    message = EngineInputs(adds=[NewRequest("a-0", [1, 2, 3], params, 2, priority=-1)],
                           aborts=["b"], stops=["c"])
    back = codec.decode_inputs(codec.encode(message))
    assert back == message
    assert back.adds[0].params == params and back.adds[0].params.stop == ("\n\n", "END")
    request = back.adds[0].to_request()
    assert request.prompt_token_ids == [1, 2, 3] and request.eos_token_id == 2
    assert request.priority == -1


def test_outputs_round_trip_each_kind() -> None:
    codec = Codec()
    logprobs = [([5, 1, 2], [-0.1, -2.5, -3.0])]
    message = StepOutputs([TokenUpdate.of(EngineCoreOutput("x", [5], True, "error", logprobs,
                                                           error="boom"))],
                          [("y", "prompt_token_ids must be in [0, 49152)")],
                          Snapshot(1, 2, 0.5, {"target": 3, "drafter": 4}, stats()))
    back = codec.decode_outputs(codec.encode(message))
    assert back == message
    assert isinstance(back, StepOutputs) and back.snapshot.stats.spec.num_draft_tokens == 6
    assert back.outputs[0].logprobs == logprobs
    for other in (Ready(123, "bfloat16"), Failed("ValueError", "KV too small")):
        assert codec.decode_outputs(codec.encode(other)) == other
    assert Failed("ValueError", "x").error == "ValueError: x"


def test_a_step_message_grows_with_the_tokens_it_carries_not_with_the_prompts() -> None:
    """What a step sends is its new tokens: the same step for requests with prompts of
    10 or 10,000 tokens is the same message (the prompt went in once, with the add)."""
    codec = Codec()
    one, sixteen = len(codec.encode(step(1))), len(codec.encode(step(16)))
    per_request = (sixteen - one) / 15
    assert per_request < 60  # id, two token ids, flags: tens of bytes
    assert len(codec.encode(step(16, tokens_each=4))) - sixteen < 16 * 4  # ~1 byte a token


def test_a_malformed_message_is_refused_naming_the_field() -> None:
    codec = Codec()
    bad = msgspec.msgpack.encode(["in", [["r", [1], {"max_tokens": 0}, None, 0]], [], [], False])
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        codec.decode_inputs(bad)
    with pytest.raises(msgspec.ValidationError):
        codec.decode_outputs(msgspec.msgpack.encode(["nope", 1]))
