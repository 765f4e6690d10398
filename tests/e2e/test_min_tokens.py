"""min_tokens: until a request has min_tokens output tokens, EOS and its
stop token ids are never sampled, and speculative verification masks each of its rows
exactly as the decode step at that position would, so greedy speculation still equals
speculation off. repetition_penalty is refused, not silently ignored."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from runner.model_loader import load_model
from runner.model_prep import resolve_model
from runner.models.llama import LlamaForCausalLM
from scheduler import SamplingParams
from tests.helpers import spec_dict

pytestmark = pytest.mark.model  # loads the real default model

CHAT = [[{"role": "user", "content": "Reply with one word: yes or no?"}],
        [{"role": "user", "content": "What is 2+2?"}]]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return load_model(resolve_model(None), torch.float32, torch.device("cpu"))


def _chat(model: LlamaForCausalLM, params: SamplingParams,
          method: str | None = None) -> list[list[int]]:
    llm = LLM(loaded_model=model, speculative_config=spec_dict(method, 3))
    outs = llm.chat(CHAT, params, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache_usage() == 0.0
    return [list(o.outputs[0].token_ids) for o in outs]


def test_eos_is_not_sampled_before_min_tokens(model: LlamaForCausalLM) -> None:
    llm_eos = LLM(loaded_model=model).tokenizer.eos_token_id
    free = _chat(model, SamplingParams(max_tokens=60))
    assert all(len(t) < 15 and t[-1] == llm_eos for t in free), free  # short answers...
    held = _chat(model, SamplingParams(max_tokens=60, min_tokens=20))
    for tokens in held:  # ...held open to 20 tokens, and none of them is EOS
        assert len(tokens) >= 20 and llm_eos not in tokens[:19], tokens


def test_stop_token_ids_wait_for_min_tokens_too(model: LlamaForCausalLM) -> None:
    first = _chat(model, SamplingParams(max_tokens=30))
    stop = first[0][2]  # a token the greedy answer emits early
    held = _chat(model, SamplingParams(max_tokens=30, min_tokens=12, stop_token_ids=(stop,)))
    assert len(held[0]) >= 12 and stop not in held[0][:11]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_min_tokens_with_speculation_equals_speculation_off(model: LlamaForCausalLM,
                                                            method: str) -> None:
    params = SamplingParams(max_tokens=40, min_tokens=25)
    assert _chat(model, params, method) == _chat(model, params)


def test_offline_stop_token_ids_are_checked_against_the_vocabulary(
        model: LlamaForCausalLM) -> None:
    llm = LLM(loaded_model=model)
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\] must be a token id in "
                                         r"\[0, 49152\), got 60000"):
        llm.generate(["hi"], SamplingParams(min_tokens=1, stop_token_ids=(60000,)))
    assert not llm.engine.has_unfinished_requests()
