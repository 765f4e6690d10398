"""Offline `generate` holds every request it will add, so it tells the scheduler that
nobody joins: once nothing waits, the goodput policy plans k to finish the batch
(scheduler/finish_plan.py). The real default model, greedy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine.llm import LLM
from scheduler import SamplingParams
from scheduler.goodput import GoodputPolicy
from tests.server_helpers import default_model

pytestmark = pytest.mark.model

PROMPTS = ["Count from one to ten:", "The days of the week are", "List three colours:"]


def test_generate_plans_its_tail_to_finish_and_stays_lossless(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[np.ndarray | None] = []
    caps = GoodputPolicy.caps

    def spy(self: GoodputPolicy, *args: Any, **kwargs: Any) -> np.ndarray:
        seen.append(kwargs.get("remaining"))
        return caps(self, *args, **kwargs)

    monkeypatch.setattr(GoodputPolicy, "caps", spy)
    params = SamplingParams(max_tokens=12)
    llm = LLM(loaded_model=default_model(), max_model_len=128, max_num_seqs=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.scheduler.arrivals_closed is False  # the next caller may be a server
    # Two run while the third waits: planned per step. Once it runs, nothing waits.
    first_planned = next(i for i, left in enumerate(seen) if left is not None)
    assert first_planned > 1  # the steps while the third prompt waited
    assert all(left is not None and (left <= 12).all() for left in seen[first_planned:])
    off = LLM(loaded_model=default_model(), max_model_len=128, max_num_seqs=2)
    want = off.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_generate_stepwise_steps_like_generate_and_leaves_nothing_when_closed() -> None:
    """One yield per engine step, the last one generate's outputs; a caller that stops
    early gets its requests aborted: nothing left in the scheduler, every KV block
    free, and the engine serves the next call."""
    llm = LLM(loaded_model=default_model(), max_model_len=128)
    params = SamplingParams(max_tokens=6)
    free = llm.engine.scheduler.kv.pool.num_free_blocks
    steps = list(llm.generate_stepwise(PROMPTS, params))
    assert len(steps) == llm.get_metrics()["num_steps"]
    whole = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in steps[-1]] == \
        [o.outputs[0].token_ids for o in whole]
    assert all(o.finished for o in steps[-1])
    partial = llm.generate_stepwise(PROMPTS, params)
    first = next(partial)
    assert not all(o.finished for o in first)
    partial.close()
    assert not llm.engine.scheduler.requests
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.pool.num_free_blocks == free
    assert llm.engine.scheduler.arrivals_closed is False
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in whole]
