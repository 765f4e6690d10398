"""A runner fault tied to one request fails that request only.

The step's requests are requeued and recomputed (nothing lost), run again with at most
one suspect per step, and the fault is traced to its request, which finishes with
"error"; everyone else gets the same tokens as in a run without the fault. Faults that
no request explains (every step failing, a broken budget invariant) still kill the
engine, as they must.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.core import MAX_FAILED_STEPS, EngineCore
from engine.llm import LLM
from runner import BudgetInvariantError
from scheduler import Request, SamplingParams
from tests.server_helpers import default_model

pytestmark = pytest.mark.model  # loads the real default model

PROMPTS = {"a": [5, 6, 7, 8], "b": [9, 10, 11], "bad": [12, 13, 14, 15, 16], "c": [17, 18]}
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def make_core(**config: Any) -> EngineCore:
    llm = LLM(loaded_model=default_model(), max_model_len=64, num_kv_blocks=32,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **config)
    return llm.engine


def inject(core: EngineCore, when: Any) -> list[str]:
    """Make the runner raise while sampling a step for which `when(req_ids)` holds."""
    real = core.runner._sample
    failed: list[str] = []

    def faulty(step: Any, *args: Any) -> Any:
        if when(step.req_ids):
            failed.append(",".join(step.req_ids))
            raise ValueError("injected fault")
        return real(step, *args)

    core.runner._sample = faulty  # type: ignore[method-assign]
    return failed


def drain(core: EngineCore) -> dict[str, tuple[list[int], str | None, str | None]]:
    out: dict[str, tuple[list[int], str | None, str | None]] = {}
    steps = 0
    while core.has_unfinished_requests():
        for u in core.step():
            tokens, _, _ = out.get(u.request_id, ([], None, None))
            out[u.request_id] = (tokens + u.new_token_ids, u.finish_reason, u.error)
        core.scheduler.kv.pool.check_integrity()
        steps += 1
        assert steps < 500
    return out


def reference() -> dict[str, list[int]]:
    core = make_core()
    for rid, prompt in PROMPTS.items():
        core.add_request(Request(rid, prompt, PARAMS))
    return {rid: tokens for rid, (tokens, _, _) in drain(core).items()}


def test_fault_of_one_request_among_several_fails_only_that_request() -> None:
    core = make_core()
    failed = inject(core, lambda ids: "bad" in ids)
    for rid, prompt in PROMPTS.items():
        core.add_request(Request(rid, prompt, PARAMS))
    out = drain(core)
    assert failed[0].split(",") == list(PROMPTS)  # all four shared the first step
    assert len(failed) == 2  # the second failure ran it as the only suspect
    tokens, reason, error = out["bad"]
    assert tokens == [] and reason == "error" and "injected fault" in (error or "")
    want = reference()
    for rid in ("a", "b", "c"):
        assert out[rid][0] == want[rid] and out[rid][1] == "length", rid
    assert core.scheduler.kv_cache_usage() == 0.0
    assert core.scheduler.stats.num_preemptions >= 3  # the innocents were recomputed
    # The engine goes on serving.
    core.add_request(Request("after", PROMPTS["a"], PARAMS))
    assert drain(core)["after"][0] == want["a"]


def test_fault_mid_generation_keeps_what_was_already_emitted() -> None:
    """A request that fails after emitting tokens: the others keep all of theirs and
    finish exactly as without the fault; the culprit's stream ends with the error."""
    core = make_core()
    state = {"steps": 0}

    def when(ids: list[str]) -> bool:
        state["steps"] += 1
        return "bad" in ids and state["steps"] > 3

    inject(core, when)
    for rid, prompt in PROMPTS.items():
        core.add_request(Request(rid, prompt, PARAMS))
    out = drain(core)
    want = reference()
    assert out["bad"][1] == "error" and out["bad"][0] == want["bad"][:len(out["bad"][0])]
    for rid in ("a", "b", "c"):
        assert out[rid][0] == want[rid], rid


def test_a_fault_no_request_explains_kills_the_engine() -> None:
    """Every step failing: each request in turn is traced as a culprit and fails, and
    after MAX_FAILED_STEPS failed steps in a row the fault is the engine's own."""
    core = make_core()
    failed = inject(core, lambda ids: True)
    for i in range(MAX_FAILED_STEPS + 2):
        core.add_request(Request(str(i), PROMPTS["a"], PARAMS))
    errors = []
    with pytest.raises(ValueError, match="injected fault"):
        for _ in range(100):
            errors += [u.request_id for u in core.step() if u.finish_reason == "error"]
    assert len(failed) == MAX_FAILED_STEPS
    assert len(errors) == MAX_FAILED_STEPS - 2  # one failed step requeued, one ended it


def test_budget_invariant_failure_is_never_blamed_on_a_request() -> None:
    core = make_core()
    real = core.runner.execute

    def broken(out: Any) -> Any:
        raise BudgetInvariantError("forged")

    core.runner.execute = broken  # type: ignore[method-assign]
    core.add_request(Request("a", PROMPTS["a"], PARAMS))
    with pytest.raises(BudgetInvariantError):
        core.step()
    core.runner.execute = real  # type: ignore[method-assign]
