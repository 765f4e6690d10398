"""Streamed chunks built from a template (`Format.sse_chunk`) are the chunks the
models build (`sse(Format.chunk(...))`), for every text a token can decode to."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.formats import ChatFormat, ChoiceState, CompletionFormat, Format, Job, sse
from engine.output import RequestDelta
from scheduler import SamplingParams

TEXTS = ["Hello", ' "quoted" \\ back', "line\nbreak\ttab", "café ü", "🙂", "\x00\x1f",
         "</script>", "", "  "]


def job() -> Job:
    return Job("cmpl-abc", [1, 2, 3], [SamplingParams(), SamplingParams()], 0, True, False)


def body(event: str) -> dict[str, Any]:
    assert event.startswith("data: ") and event.endswith("\n\n")
    parsed: dict[str, Any] = json.loads(event[len("data: "):])
    return parsed


@pytest.mark.parametrize("kind", [CompletionFormat, ChatFormat])
def test_a_templated_chunk_is_the_chunk_the_models_build(kind: type[Format]) -> None:
    fmt = kind("smollm2-135m", None, job(), None)  # type: ignore[arg-type]
    states = [ChoiceState(), ChoiceState()]
    for step, text in enumerate(TEXTS):
        for index in (0, 1):
            finished = step == len(TEXTS) - 1
            delta = RequestDelta(f"cmpl-abc-{index}", [5], text, finished,
                                 "length" if finished else None, 3, step + 1)
            fast = fmt.sse_chunk(index, delta, states[index])
            slow = sse(fmt.chunk(index, delta, states[index]))
            got, want = body(fast), body(slow)
            assert abs(got.pop("created") - want.pop("created")) <= 1
            assert got == want
            (choice,) = got["choices"]
            assert choice["index"] == index
            assert (choice.get("text") if kind is CompletionFormat
                    else choice["delta"]["content"]) == text
            assert choice["finish_reason"] == ("length" if finished else None)
            assert fast.isascii()  # escaped exactly as the models' dump escapes


def test_every_chunk_of_a_choice_shares_its_created() -> None:
    fmt = CompletionFormat("m", None, job(), None)  # type: ignore[arg-type]
    state = ChoiceState()
    created = {body(fmt.sse_chunk(0, RequestDelta("r", [1], t, False, None, 1, 1),
                                  state))["created"] for t in TEXTS}
    assert len(created) == 1


def test_logprobs_take_the_models_path() -> None:
    """With logprobs asked, every chunk is built whole (they change per token)."""
    fmt = ChatFormat("m", None, job(), 1)  # type: ignore[arg-type]
    delta = RequestDelta("r", [], "x", False, None, 1, 1)  # no logprob entries this step
    assert body(fmt.sse_chunk(0, delta, ChoiceState()))["choices"][0]["logprobs"] == {
        "content": []}
    assert not fmt._templates
