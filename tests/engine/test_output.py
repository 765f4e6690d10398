"""Detokenizer, output processor and tokenizer details the server relies on (stop
strings, logprob bytes, the prompt-size bound), on the default model's tokenizer."""

from __future__ import annotations

import functools

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.output import OutputProcessor
from engine.tokenizer import Tokenizer
from runner.model_prep import resolve_model
from scheduler import EngineCoreOutput, SamplingParams

pytestmark = pytest.mark.model  # loads the real default model


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model(None))


def test_stop_string_inside_a_multi_token_step_drops_the_tokens_after_it() -> None:
    """A verification step emits "... Paris. It is" at once; with stop "." the tokens
    after the stop string are dropped, with their logprobs, exactly as one token per
    step would have stopped."""
    tok = tokenizer()
    ids = tok.encode(" Paris. It is big")
    stop_at = next(i for i in range(1, len(ids) + 1) if "." in tok.decode(ids[:i]))
    processor = OutputProcessor(tok)
    processor.add("r", 3, SamplingParams(stop=(".",)))
    logprobs = [([t], [-0.5]) for t in ids]
    deltas, to_abort, _ = processor.process([EngineCoreOutput("r", ids, False, None, logprobs)])
    (delta,) = deltas
    assert to_abort == ["r"] and delta.finished and delta.finish_reason == "stop"
    assert delta.new_token_ids == ids[:stop_at]
    assert delta.logprobs == logprobs[:stop_at]
    assert delta.num_output_tokens == stop_at
    assert delta.delta_text == " Paris"

    # Token by token (speculation off) gives the same count, text and reason.
    one = OutputProcessor(tok)
    one.add("r", 3, SamplingParams(stop=(".",)))
    seen: list[int] = []
    for t in ids:
        (d,), _, _ = one.process([EngineCoreOutput("r", [t], False, None, [([t], [-0.5])])])
        seen += d.new_token_ids
        if d.finished:
            break
    assert seen == delta.new_token_ids and d.finish_reason == "stop"


def test_stop_string_wins_over_a_length_finish_in_the_same_step() -> None:
    tok = tokenizer()
    ids = tok.encode(" Paris. It")
    processor = OutputProcessor(tok)
    processor.add("r", 3, SamplingParams(stop=(".",)))
    (delta,), to_abort, _ = processor.process([EngineCoreOutput("r", ids, True, "length")])
    assert delta.finish_reason == "stop" and to_abort == []  # the engine already ended it
    assert delta.delta_text == " Paris"


def test_detokenizer_push_reports_tokens_taken() -> None:
    tok = tokenizer()
    detok = IncrementalDetokenizer(tok, stop=("fox",))
    assert detok.push(tok.encode("The quick brown")) is None
    taken = detok.push(tok.encode(" fox jumps over"))
    assert taken == 1 and detok.text == "The quick brown "


def test_token_bytes_rebuild_characters_split_across_tokens() -> None:
    tok = tokenizer()
    text = "Café 😀 👍🏽 naïve 中文"
    ids = tok.encode(text)
    pieces = [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # some tokens hold part of a character
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == text
    special = tok.encode("<|im_start|>")
    assert tok.token_bytes(special[0]) == b"<|im_start|>"


def test_min_num_tokens_is_a_true_lower_bound() -> None:
    tok = tokenizer()
    for text in ("hello world " * 50, "#" * 500, "\n" + " " * 400, "😀" * 30, "a"):
        assert tok.min_num_tokens(text) <= len(tok.encode(text)), text[:20]
    assert tok.min_num_tokens("x" * 81 * 1000) >= 1000


def test_a_stop_string_finishes_the_request_with_stop_in_the_scheduler_too() -> None:
    from engine.llm import LLM
    from scheduler import Request
    from scheduler.request import RequestStatus
    from tests.server_helpers import default_model

    llm = LLM(loaded_model=default_model(), max_model_len=64, num_kv_blocks=16)
    seen: list[Request] = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda request: (seen.append(request), add(request))[1]  # type: ignore[method-assign]
    (out,) = llm.generate(["The capital of France is"],
                          SamplingParams(max_tokens=16, stop=("Paris",)), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    assert seen[0].status == RequestStatus.FINISHED_STOPPED
    assert llm.engine.scheduler.kv_cache_usage() == 0.0
