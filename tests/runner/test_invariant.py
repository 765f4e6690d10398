"""Mutation tests: a scheduler output broken on purpose must be refused by the real
runner with BudgetInvariantError, before any buffer or request state is written
(DESIGN.md §2). The runner re-derives the k rule from its own copy
of each request's lengths and max_tokens, so these fail without that check (the pard
case used to crash later with a numpy broadcast error)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.core import EngineCore
from engine.llm import LLM
from runner import BudgetInvariantError
from scheduler import Request, SamplingParams, SchedulerOutput
from tests.helpers import spec_dict
from tests.server_helpers import default_model

pytestmark = pytest.mark.model  # loads the real default model

PROMPT = list(range(100, 124))  # 24 tokens


def core_for(method: str, **config: int) -> EngineCore:
    return LLM(loaded_model=default_model(), max_num_batched_tokens=64, num_kv_blocks=16,
               max_model_len=config.pop("max_model_len", 128),
               speculative_config=spec_dict(method, 4, draft_policy="fixed"),
               **config).engine


def forge(out: SchedulerOutput, rid: str, k: int, extra_rows: int) -> SchedulerOutput:
    """`out` with k drafts declared for `rid`; the drafter rows moved to match, so only
    the k rule can tell."""
    drafts = {**out.num_draft_tokens, rid: k}
    return dataclasses.replace(out, num_draft_tokens=drafts,
                               num_drafter_tokens=out.num_drafter_tokens + extra_rows)


def assert_refused_untouched(core: EngineCore, out: SchedulerOutput, match: str) -> None:
    runner = core.runner
    runner.buffers.input_ids.np[:] = -7
    before = (dict(runner.states.row_of), runner.states.num_computed.copy(),
              runner.states.num_tokens.copy())
    with pytest.raises(BudgetInvariantError, match=match):
        runner.execute(out)
    assert (runner.buffers.input_ids.np == -7).all()
    assert runner.states.row_of == before[0]
    assert np.array_equal(runner.states.num_computed, before[1])
    assert np.array_equal(runner.states.num_tokens, before[2])


@pytest.mark.parametrize(("method", "extra"), [("ngram", 0), ("pard", 2)])
def test_k_above_the_rule_near_max_model_len(method: str, extra: int) -> None:
    """max_tokens 4 cuts k to 4 - (0 + 0) - 2 = 2; declaring 4 (with the drafter's rows
    raised to match, for pard) is refused."""
    core = core_for(method, max_model_len=128)
    core.add_request(Request("r", PROMPT, SamplingParams(max_tokens=4)))
    out = core.scheduler.schedule()
    assert out.num_draft_tokens == {"r": 2}
    assert_refused_untouched(core, forge(out, "r", 4, extra), r"declared k=4 .* allows 2")
    core.runner.execute(out)  # the honest output runs


def test_k_on_a_chunk_that_does_not_sample() -> None:
    core = core_for("ngram", max_model_len=128)
    core.add_request(Request("r", list(range(100, 180)), SamplingParams(max_tokens=8)))
    out = core.scheduler.schedule()  # 64 of 80 prompt tokens: no sample, k = 0
    assert out.num_scheduled_tokens == {"r": 64} and out.num_draft_tokens == {}
    assert_refused_untouched(core, forge(out, "r", 2, 0), r"declared k=2 .* allows 0")


def test_k_above_the_rule_for_a_running_request() -> None:
    """A cached (running) request: the runner uses its own row's lengths, not the
    scheduler's; max_model_len 32 cuts k to 32 - (25 + s + 2)."""
    core = core_for("ngram", max_model_len=32)
    core.add_request(Request("r", PROMPT, SamplingParams(max_tokens=100)))
    core.step()
    out = core.scheduler.schedule()
    s = len(out.scheduled_spec_decode_tokens.get("r", ()))
    allowed = max(0, min(4, 32 - (25 + s + 2)))
    assert out.num_draft_tokens.get("r", 0) == allowed
    assert_refused_untouched(core, forge(out, "r", allowed + 1, 0),
                             rf"declared k={allowed + 1} .* allows {allowed}")


def test_the_model_runner_holds_a_step_to_its_own_budget() -> None:
    """A step planned for B = 128 handed to a runner sized for B = 64 is refused before
    anything is written."""
    from scheduler import CacheConfig, Scheduler, SchedulerConfig

    core = core_for("ngram")  # B = 64
    wide = Scheduler(SchedulerConfig(128, 16, 128), CacheConfig(num_blocks=16, block_size=16))
    wide.add_request(Request("r", list(range(100, 200)), SamplingParams(max_tokens=4)))
    out = wide.schedule()
    assert out.total_num_scheduled_tokens == 100
    assert_refused_untouched(core, out, r"max_num_batched_tokens=64")
