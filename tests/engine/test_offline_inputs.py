"""The offline API refuses what the server refuses, with the same words, before it
queues anything: one bad prompt in a batch loses nothing and leaves the LLM usable."""

from __future__ import annotations

from typing import Any

import pytest

from engine.llm import LLM
from scheduler import SamplingParams

pytestmark = pytest.mark.model  # loads the real default model

PARAMS = SamplingParams(max_tokens=3)


@pytest.fixture(scope="module")
def llm() -> LLM:
    """Over the model the server tests share (float32), so the offline and served
    figures compare like with like whatever dtype "auto" picks on this CPU."""
    from tests.server_helpers import default_model

    return LLM(loaded_model=default_model(), max_model_len=128)


def _still_serves(llm: LLM) -> None:
    """Nothing queued or held after a refusal, and the next call works."""
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache_usage() == 0.0
    (out,) = llm.generate(["hello there"], PARAMS, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize(("prompts", "message"), [
    (["hello there", 123], r"prompts\[1\] must be a string or a list of token ids, got int"),
    (["hello there", None], r"prompts\[1\] must be a string or a list of token ids"),
    (["hello there", {"a": 1}], r"prompts\[1\] must be a string or a list of token ids"),
    (["hello there", ""], r"prompts\[1\]: prompt must be a non-empty string"),
    ([[1.7, 2]], r"prompts\[0\]: prompt\.0 must be an integer token id, got 1\.7"),
    ([[True, 5]], r"prompts\[0\]: prompt\.0 must be an integer token id, got True"),
    ([[5, 10**6]], r"prompts\[0\]: prompt must be token ids in \[0, 49152\)"),
    ([], r"prompts must be a non-empty string, or a non-empty list"),
    (["hello there", "word " * 200], r"maximum context length|max_model_len"),
])
def test_a_bad_prompt_refuses_the_batch_and_loses_nothing(llm: LLM, prompts: Any,
                                                          message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, PARAMS, use_tqdm=False)
    _still_serves(llm)


def test_sampling_params_of_the_wrong_type_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.ignore_eos must be True or False"):
        SamplingParams(ignore_eos="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate(["hello there"], {"max_tokens": 3}, use_tqdm=False)  # type: ignore[arg-type]
    _still_serves(llm)


@pytest.mark.parametrize(("messages", "message"), [
    ([], r"messages must be a non-empty list"),
    ([{"role": "wizard", "content": "hi"}], r"messages\.0\.role must be one of"),
    ([{"role": "user"}], r"messages\.0\.content is required for a 'user' message"),
    ([{"role": "user", "content": [{"type": "image_url"}]}],
     r"messages\.0\.content\.0 must be a text part"),
    ([[{"role": "user", "content": "hi"}], [{"role": "bad", "content": "x"}]],
     r"conversations\[1\]: messages\.0\.role must be one of"),
])
def test_chat_refuses_what_the_server_refuses(llm: LLM, messages: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, PARAMS, use_tqdm=False)
    _still_serves(llm)


def test_chat_accepts_text_parts_as_the_server_does(llm: LLM) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "},
                                          {"type": "text", "text": "hi."}]}]
    plain = [{"role": "user", "content": "Say hi."}]
    (a,) = llm.chat(parts, PARAMS, use_tqdm=False)
    (b,) = llm.chat(plain, PARAMS, use_tqdm=False)
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_offline_logprobs_are_the_servers(llm: LLM) -> None:
    """Offline outputs carry the logprobs the server reports for the same request (the
    same values and token names, "bytes:" ones included), and their sum."""
    from openai import OpenAI

    from tests.server_helpers import MODEL_NAME, make_engine, serve

    prompt = "😀😃😄😁"
    params = SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 5
    engine = make_engine(max_model_len=128)
    try:
        with serve(engine) as server:
            client = OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0)
            served = client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                extra_body={"ignore_eos": True}).choices[0].logprobs
    finally:
        engine.shutdown()
    assert served is not None and served.top_logprobs is not None
    for i, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs,
                                              strict=True)):
        sampled = entry[token_id]
        assert served.tokens[i] == sampled.decoded_token
        assert served.token_logprobs[i] == sampled.logprob
        top = {e.decoded_token: e.logprob for e in entry.values() if e.rank is not None}
        assert served.top_logprobs[i] == top
        assert sampled.rank == 1  # greedy
    assert any(lp.decoded_token.startswith("bytes:") for e in completion.logprobs
               for lp in e.values())
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs,
                                         strict=True)))
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
