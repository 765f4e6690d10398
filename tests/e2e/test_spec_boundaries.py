"""Every method driven to its length limits on the default model.

Near `max_model_len` a step that verifies s drafts and the next one that verifies k
can together emit s + k + 2 tokens; the k rule must leave room for all of them, or the
runner writes past its max_model_len-wide token buffer (the IndexError that killed
the engine). Prompts repeat a pattern so that ngram and suffix really draft and
accept right up to the boundary; the random heads draft and get rejected.
"""

from __future__ import annotations

import pytest

from engine.llm import LLM
from scheduler import Request, SamplingParams
from spec_decode import METHODS
from tests.helpers import spec_dict
from tests.server_helpers import default_model

pytestmark = pytest.mark.model  # loads the real default model

MAX_LEN = 64
K = 4
PATTERN = [28, 29, 30] * 40
# (prompt tokens, max_tokens): generation ends one before, exactly at and one after
# max_model_len (max_tokens binds, both bind, the context binds); prompts one and two
# tokens short of the limit; and max_tokens of 1-3, where K=4 is cut to 0-1.
CASES = [(52, 11), (52, 12), (52, 13), (MAX_LEN - 2, 100), (MAX_LEN - 1, 100),
         (10, 1), (10, 2), (10, 3)]

_reference: list[list[list[int]]] = []


def generate(method: str | None, **options: object
             ) -> tuple[LLM, list[list[int]], list[str | None]]:
    """Every case at once, one request each (LLM.generate takes one SamplingParams for
    all its prompts; the core takes one per request)."""
    return run_cases(spec_dict(method, K, **options))


def run_cases(spec: dict | None) -> tuple[LLM, list[list[int]], list[str | None]]:
    """Every case under this speculative config (None: off)."""
    llm = LLM(loaded_model=default_model(), speculative_config=spec, max_model_len=MAX_LEN,
              max_num_batched_tokens=64, num_kv_blocks=64)
    for i, (p, m) in enumerate(CASES):
        llm.engine.add_request(Request(str(i), PATTERN[:p], SamplingParams(
            max_tokens=m, ignore_eos=True)))
    tokens: list[list[int]] = [[] for _ in CASES]
    reasons: list[str | None] = [None] * len(CASES)
    while llm.engine.has_unfinished_requests():
        for update in llm.engine.step():
            tokens[int(update.request_id)] += update.new_token_ids
            if update.finished:
                reasons[int(update.request_id)] = update.finish_reason
    return llm, tokens, reasons


def reference() -> list[list[int]]:
    if not _reference:
        _reference.append(generate(None)[1])
    return _reference[0]


@pytest.mark.parametrize("method", [None, *METHODS])
def test_every_method_stops_exactly_at_the_limits(method: str | None) -> None:
    """Greedy output equal to speculation off, finish reason length, never a token past
    max_model_len or max_tokens, and every KV block back."""
    llm, tokens, reasons = generate(method)
    for (p, m), out, reason in zip(CASES, tokens, reasons, strict=True):
        assert len(out) == min(m, MAX_LEN - p), (p, m, len(out))
        assert reason == "length", (p, m, reason)
    assert tokens == reference()
    assert llm.engine.scheduler.kv_cache_usage() == 0.0
    if method in ("ngram", "suffix"):
        # The pattern is drafted and accepted up to the boundary, not merely survived.
        assert llm.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_a_gated_chain_stops_exactly_at_the_limits(method: str) -> None:
    """A chain drafter's confidence gate (runner/draft_gate.py) at the limits: a random
    head's drafts sit near 1 / 8192, so at this threshold some chains stop after one
    draft and others go on to a second, never further (the product of two is far
    below it); outputs, finishes and KV as speculation off."""
    llm, tokens, reasons = generate(method, min_draft_confidence=1.25e-4,
                                    draft_policy="fixed")
    assert tokens == reference()
    assert reasons == ["length"] * len(CASES)
    assert llm.engine.scheduler.kv_cache_usage() == 0.0
    drafted = llm.get_metrics()["spec_decode"]["num_draft_tokens_per_pos"]
    assert 0 < drafted[1] < drafted[0] and sum(drafted[2:]) == 0, drafted


def test_solo_runs_equal_the_batch() -> None:
    """The batched reference is what each case gives alone with speculation off."""
    llm = LLM(loaded_model=default_model(), max_model_len=MAX_LEN, num_kv_blocks=64)
    for (p, m), want in zip(CASES[:3], reference(), strict=False):
        (out,) = llm.generate([PATTERN[:p]], SamplingParams(max_tokens=m, ignore_eos=True),
                              use_tqdm=False)
        assert out.outputs[0].token_ids == want


def test_prompt_at_the_limit_is_refused_with_the_numbers() -> None:
    llm = LLM(loaded_model=default_model(), max_model_len=MAX_LEN, num_kv_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": K})
    with pytest.raises(ValueError, match=rf"prompt of {MAX_LEN} tokens .* max_model_len={MAX_LEN}"):
        llm.generate([PATTERN[:MAX_LEN]], SamplingParams(max_tokens=1), use_tqdm=False)
    (out,) = llm.generate([PATTERN[:10]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
