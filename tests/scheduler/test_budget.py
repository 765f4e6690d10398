"""Scenario tests for the throttle: each method's charge and the cases from vLLM's history."""

from __future__ import annotations

import numpy as np
import pytest

from runner import BudgetInvariantError, check_pass_rows
from runner.simulated import SimulatedRunner
from scheduler.budget import RequestView, ThrottleRule, k_rule, plan_chunk
from scheduler.step_record import StepRecord
from spec_decode import METHODS, SpeculativeConfig
from spec_decode.methods import SpecMethod, method_names, registered
from tests.helpers import drain, make_request, make_scheduler, run_step

# DESIGN.md §1, restated: rows of each drafter pass for n scheduled tokens, k drafts.
# Written out by hand on purpose, never read from the method classes: it is the oracle
# their cost tables are checked against. A new method adds its row here.
TABLE = {
    "ngram": lambda n, k: {},
    "suffix": lambda n, k: {},
    "eagle": lambda n, k: {"draft": n},
    "mtp": lambda n, k: {"draft": n},
    "draft_model": lambda n, k: {"draft": n + 1 if k else n},
    "parallel": lambda n, k: {"draft": n + k - 1 if k else n},
    "pard": lambda n, k: {"draft": n + k if k else n},
    "dflash": lambda n, k: {"context": n, "query": k + 1 if k else 0},
}


def design_rows(method: str, n: int, k: int) -> dict[str, int]:
    """TABLE's rows for `method`; a method the table lacks fails the test by name."""
    if method not in TABLE:
        pytest.fail(f"method {method!r} is registered but has no row in this file's TABLE: "
                    "restate its DESIGN.md §1 rows there")
    return TABLE[method](n, k)


def missing_from_table() -> list[str]:
    return sorted(set(method_names()) - TABLE.keys())


def test_the_table_covers_every_registered_method() -> None:
    missing = missing_from_table()
    assert not missing, f"registered methods without a row in TABLE: {missing}"


def test_a_registered_method_missing_from_the_table_is_named() -> None:
    class Absent(SpecMethod):
        name = "absent-from-table"

    with registered(Absent):
        assert missing_from_table() == ["absent-from-table"]
        with pytest.raises(pytest.fail.Exception, match="method 'absent-from-table' is "
                                                        "registered but has no row"):
            design_rows("absent-from-table", 1, 1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n,k", [(1, 0), (7, 0), (1, 1), (5, 4), (3, 2)])
def test_layout_matches_design_table(method: str, n: int, k: int) -> None:
    spec_method = SpeculativeConfig(method, 4).spec_method
    assert dict(zip(spec_method.pass_names, spec_method.rows(n, k))) == design_rows(method, n, k)


@pytest.mark.parametrize("method", METHODS)
def test_decode_step_charges_table_rows(method: str) -> None:
    """Two decoding requests with 4 drafts each: every pass gets exactly the table's rows."""
    sched = make_scheduler(method, k=4, budget=64, max_model_len=512)
    runner = SimulatedRunner(sched, acceptance=0.0, seed=0)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=100))
    run_step(sched, runner)  # prefill; both sample and propose 4 drafts
    out, _ = run_step(sched, runner)
    assert out.num_scheduled_tokens == {"r0": 5, "r1": 5}
    assert out.num_draft_tokens == {"r0": 4, "r1": 4}
    expected = {"target": 10}
    for name, rows in design_rows(method, 5, 4).items():
        expected[name] = 2 * rows
    assert out.pass_rows == expected
    assert out.num_drafter_tokens == max([v for n, v in expected.items() if n != "target"],
                                         default=0)


def test_vllm_overflow_case_dflash_k8_never_exceeds_budget() -> None:
    """B=2048, 256 decoding requests, dflash K=8: unthrottled, each decode would put
    1+8 target rows and 9 query rows in, 2304 > 2048. Every pass must stay <= B."""
    budget = 2048
    sched = make_scheduler("dflash", k=8, budget=budget, max_num_seqs=256, max_model_len=512,
                           block_size=16, num_blocks=256 * 8)
    runner = SimulatedRunner(sched, acceptance=0.7, seed=3)
    for i in range(256):
        sched.add_request(make_request(f"r{i}", 16, max_tokens=64))
    peak: dict[str, int] = {}
    shrunk = 0
    steps = 0
    while sched.has_unfinished_requests():
        out, result = run_step(sched, runner)
        for name, rows in result.pass_rows.items():
            assert rows <= budget, (name, rows)
            peak[name] = max(peak.get(name, 0), rows)
        shrunk += sum(1 for rid, n in out.num_scheduled_tokens.items()
                      if 1 < n < 9 and out.num_draft_tokens.get(rid))
        steps += 1
    assert sched.kv_cache_usage() == 0.0
    # The throttle really bound: passes ran near B and some decodes verified fewer drafts.
    assert peak["target"] > budget - 9 and peak["query"] > budget - 9
    assert shrunk > 0


@pytest.mark.parametrize("policy", ["fixed", "fit"])
def test_adaptive_policy_cuts_k_where_fixed_defers_sampling(policy: str) -> None:
    """256 four-token prompts, dflash K=8, B=2048: 1024 target rows fit, but 256 query
    blocks of 9 rows (2304) do not. "fixed" lets only 227 prompts sample this step (the
    rest stop one token short); "fit" samples all 256, cutting k where the query pass
    is full and reporting each cut with the k the rule allowed."""
    budget = 2048
    sched = make_scheduler("dflash", k=8, budget=budget, max_num_seqs=256, max_model_len=512,
                           block_size=16, num_blocks=256 * 8, draft_policy=policy)
    for i in range(256):
        sched.add_request(make_request(f"r{i}", 4, max_tokens=64))
    out = sched.schedule()
    assert len(out.num_scheduled_tokens) == 256
    assert out.pass_rows["query"] <= budget
    whole = sum(1 for n in out.num_scheduled_tokens.values() if n == 4)
    if policy == "fixed":
        assert whole == budget // 9 and not out.adapted_draft_tokens
    else:
        assert whole == 256
        assert out.adapted_draft_tokens
        for rid, rule_k in out.adapted_draft_tokens.items():
            assert out.num_draft_tokens.get(rid, 0) < rule_k == 8


def test_52922_two_prefills_admitted_whole_under_dflash() -> None:
    """B=16, K=4, two 8-token prefills: 16 target rows, 16 context rows, 10 query rows.
    A flat per-request charge (8 + 5 each) would have admitted only one."""
    sched = make_scheduler("dflash", k=4, budget=16, max_model_len=128)
    sched.add_request(make_request("a", 8, max_tokens=16))
    sched.add_request(make_request("b", 8, max_tokens=16))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 8, "b": 8}
    assert out.num_draft_tokens == {"a": 4, "b": 4}
    assert out.pass_rows == {"target": 16, "context": 16, "query": 10}


@pytest.mark.parametrize("method", ["pard", "parallel", "draft_model", "dflash"])
def test_partial_prefill_chunk_is_charged_no_drafting_rows(method: str) -> None:
    sched = make_scheduler(method, k=4, budget=32, max_model_len=256)
    runner = SimulatedRunner(sched, seed=0)
    sched.add_request(make_request("p", 100, max_tokens=8))
    chunks = []
    while True:
        out, result = run_step(sched, runner)
        n = out.num_scheduled_tokens["p"]
        chunks.append(n)
        if result.sampled_token_ids[0]:
            break
        # A chunk that does not sample proposes nothing and adds no extra rows.
        assert out.num_draft_tokens == {}
        assert out.num_drafter_tokens == n
    assert chunks[:-1] == [32, 32, 32]
    # The last chunk samples: it carries k = 4 and the method's extra rows.
    assert chunks[-1] == 4 and out.num_draft_tokens == {"p": 4}
    assert out.num_drafter_tokens == max(design_rows(method, 4, 4).values())


def test_drafts_stop_at_max_model_len() -> None:
    """k = max_model_len - (num_tokens + s + 2): even if this step and the next accept
    every draft, the request ends with exactly max_model_len tokens, never more."""
    sched = make_scheduler("pard", k=4, budget=64, max_model_len=64)
    runner = SimulatedRunner(sched, acceptance=1.0, seed=0)
    sched.add_request(make_request("r", 60, max_tokens=100))
    request = sched.requests["r"]
    out, _ = run_step(sched, runner)
    assert out.num_draft_tokens == {"r": 2}  # 64 - (60 + 0 + 2)
    ks = []
    while sched.has_unfinished_requests():
        out, _ = run_step(sched, runner)
        ks.append(out.num_draft_tokens.get("r", 0))
        assert runner.last_step is not None
        assert runner.last_step.max_position() < 64
    assert ks == [0]  # 61 tokens + 2 accepted + 1 bonus = 64: the last step drafts nothing
    assert request.num_tokens == 64 and request.finish_reason == "length"


def test_k_rule_counts_verified_drafts_in_both_cuts() -> None:
    """s drafts verified now may all be accepted: both cuts leave room for them
    (21 tokens known, 5 of them outputs, 3 drafts verified)."""
    # max_tokens cut: 12 - (5 + 3) - 2 = 2; without s it would be 5.
    assert k_rule(4, 1000, 21, 5, 12, 3) == 2
    # max_model_len cut: 30 - (21 + 3 + 2) = 4, and 29 - 26 = 3.
    assert k_rule(8, 30, 21, 5, 100, 3) == 4
    assert k_rule(8, 29, 21, 5, 100, 3) == 3
    assert k_rule(8, 26, 21, 5, 100, 3) == 0


def test_k_rule_on_arrays_is_the_rule_on_each_request() -> None:
    """The bulk plan's call (arrays) and plan_chunk's (one request) are one rule."""
    tokens, output, max_tokens, spec = [21, 21, 21, 40], [5, 5, 5, 0], [12, 100, 100, 50], \
        [3, 3, 0, 1]
    many = k_rule(8, 29, *(np.array(a) for a in (tokens, output, max_tokens, spec)))
    assert many.tolist() == [int(k_rule(8, 29, *one))
                             for one in zip(tokens, output, max_tokens, spec)] == [2, 3, 6, 0]


def test_drafts_cut_by_remaining_max_tokens() -> None:
    sched = make_scheduler("dflash", k=4, budget=64)
    sched.add_request(make_request("r", 8, max_tokens=4))
    out = sched.schedule()
    assert out.num_draft_tokens == {"r": 2}  # max_tokens - 0 - 2
    sched2 = make_scheduler("dflash", k=4, budget=64)
    sched2.add_request(make_request("r", 8, max_tokens=1))
    out2 = sched2.schedule()
    assert out2.num_draft_tokens == {} and out2.pass_rows["query"] == 0


def test_decode_that_does_not_fit_verifies_fewer_drafts() -> None:
    """eagle K=4, B=7: the first decode takes 5 rows, the second gets 2 (1 draft)."""
    sched = make_scheduler("eagle", k=4, budget=7, max_model_len=256)
    runner = SimulatedRunner(sched, acceptance=0.0, seed=0)
    sched.add_request(make_request("a", 3, max_tokens=50))
    sched.add_request(make_request("b", 3, max_tokens=50))
    run_step(sched, runner)  # both prefills: 6 rows
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 5, "b": 2}
    assert len(out.scheduled_spec_decode_tokens["b"]) == 1
    assert sched.requests["b"].spec_token_ids == out.scheduled_spec_decode_tokens["b"]


def test_query_pass_full_leaves_a_decode_waiting_not_overflowing() -> None:
    """dflash K=4, B=8: sampling costs 5 query rows, so only one request may sample per
    step. The other takes a chunk that stops short of sampling, or waits."""
    sched = make_scheduler("dflash", k=4, budget=8, max_model_len=256)
    runner = SimulatedRunner(sched, acceptance=0.0, seed=0)
    sched.add_request(make_request("a", 3, max_tokens=50))
    sched.add_request(make_request("b", 3, max_tokens=50))
    out, _ = run_step(sched, runner)
    # b's whole prompt would sample (5 more query rows): it gets 2 of its 3 tokens.
    assert out.num_scheduled_tokens == {"a": 3, "b": 2}
    assert out.num_draft_tokens == {"a": 4}
    assert out.pass_rows == {"target": 5, "context": 5, "query": 5}
    out, _ = run_step(sched, runner)
    # a verifies its 4 drafts and samples; b's last token would sample too: it waits.
    assert out.num_scheduled_tokens == {"a": 5}
    assert out.pass_rows["query"] == 5


def test_plan_chunk_is_largest_fit() -> None:
    """Against brute force: the chosen n is the largest n whose rows fit every pass."""
    rule = ThrottleRule(SpeculativeConfig("pard", 4).spec_method, 4, 100)
    for remaining in ([9, 9], [20, 12], [6, 30], [3, 3], [50, 7]):
        for computed, tokens, spec in ((0, 30, 0), (29, 30, 4), (10, 30, 0), (95, 96, 2)):
            req = RequestView(computed, tokens, spec, 1, 50)
            plan = plan_chunk(rule, remaining, req, tokens + spec - computed, True)
            fits = []
            for n in range(1, tokens + spec - computed + 1):
                s = max(0, n - (tokens - computed))
                k = k_rule(4, 100, tokens, 1, 50, s) if n >= tokens - computed else 0
                rows = (n, n + k if k else n)
                if all(r <= rem for r, rem in zip(rows, remaining)):
                    fits.append(n)
            assert (plan.num_tokens if plan else None) == (max(fits) if fits else None)


def test_step_record_refund_is_exact() -> None:
    """A refund gives back exactly the row's charge and masks it; restoring it keeps
    its place in the step's order."""
    rule = ThrottleRule(SpeculativeConfig("dflash", 4).spec_method, 4, 100)
    record = StepRecord(rule, 64, 4)
    a = rule.plan(5, 4, 4)
    b = rule.plan(10, 0, 0, samples=False)  # a prefill piece: context rows, no drafts
    record.append(make_request("a", 4), a, 0, 0)
    record.append(make_request("b", 4), b, 0, 0)
    assert record.remaining == [64 - 15, 64 - 15, 64 - 5]
    assert record.refund(record.index("a")) == a
    assert record.remaining == [54, 54, 64] and record.index("a") is None
    assert record.plans() == [b]
    record.restore(0, a, 0)
    assert record.plans() == [a, b] and record.remaining == [49, 49, 59]
    record.refund(0)
    record.refund(1)
    assert record.remaining == [64, 64, 64] and record.plans() == []


def test_preemption_refunds_charge_and_rows_still_match() -> None:
    """Priority policy: a high-priority request needing blocks preempts a lower one that
    was already scheduled this step; the declared rows drop by exactly its charge."""
    sched = make_scheduler("pard", k=2, budget=64, max_model_len=64, num_blocks=14,
                           policy="priority")
    runner = SimulatedRunner(sched, acceptance=1.0, seed=0)
    for rid, prio in (("hi", 0), ("lo", 5)):
        req = make_request(rid, 4, max_tokens=40, ignore_eos=True)
        req.priority = prio
        sched.add_request(req)
    saw = False
    while sched.has_unfinished_requests():
        out, _ = run_step(sched, runner)  # the runner asserts declared == built
        if out.preempted_req_ids:
            saw = True
            assert "lo" in out.preempted_req_ids and "lo" not in out.num_scheduled_tokens
            rows = sum(n + out.num_draft_tokens.get(r, 0)
                       for r, n in out.num_scheduled_tokens.items())
            assert out.pass_rows["draft"] == rows
    assert saw
    assert sched.kv_cache_usage() == 0.0


@pytest.mark.parametrize("method", ["ngram", "suffix", "eagle", "mtp"])
def test_no_extra_row_methods_schedule_like_spec_off(method: str) -> None:
    """With a proposer that finds nothing, the schedule is step-for-step that of spec off."""
    def schedule_trace(spec_method: str | None) -> list[dict[str, int]]:
        sched = make_scheduler(spec_method, k=4, budget=24, max_num_seqs=6, num_blocks=400)
        runner = SimulatedRunner(sched, seed=5, eos_token_id=2, eos_prob=0.05,
                                 propose=lambda rid, k: [])
        for i in range(12):
            sched.add_request(make_request(f"r{i}", 5 + 7 * i, max_tokens=10 + i))
        trace = []
        while sched.has_unfinished_requests():
            out, _ = run_step(sched, runner)
            trace.append(out.num_scheduled_tokens)
        return trace

    assert schedule_trace(method) == schedule_trace(None)


def test_runner_check_names_method_pass_and_counts() -> None:
    with pytest.raises(BudgetInvariantError, match=r"dflash.*'query'.*17.*16"):
        check_pass_rows("dflash", 16, {"target": 10, "context": 10, "query": 17}, 17)
    with pytest.raises(BudgetInvariantError, match=r"built 12 rows.*declared 10"):
        check_pass_rows("pard", 16, {"target": 10, "draft": 12}, 10)
    check_pass_rows("pard", 16, {"target": 10, "draft": 12}, 12)


def test_runner_rejects_a_schedule_over_budget() -> None:
    """A SchedulerOutput claiming fewer drafter rows than it implies is caught."""
    sched = make_scheduler("pard", k=4, budget=32)
    runner = SimulatedRunner(sched, seed=0)
    sched.add_request(make_request("r", 10, max_tokens=20))
    out = sched.schedule()
    out.num_drafter_tokens -= 1
    with pytest.raises(BudgetInvariantError, match=r"draft.*built \d+ rows.*declared"):
        runner.execute(out)


def test_mixed_workload_drains_for_every_method() -> None:
    for method in (None, *METHODS):
        sched = make_scheduler(method, k=3, budget=48, max_num_seqs=8, num_blocks=60)
        runner = SimulatedRunner(sched, seed=1, eos_token_id=2, eos_prob=0.02)
        for i in range(20):
            sched.add_request(make_request(f"r{i}", 3 + 11 * i % 90, max_tokens=5 + i))
        drain(sched, runner)
        assert sched.kv.pool.num_free_blocks == 60


def test_a_runner_holds_a_step_to_its_own_budget() -> None:
    """A step planned by a scheduler with a larger B than the runner was built for is
    held to the runner's B (the model runner's buffers have only that many rows)."""
    wide, narrow = make_scheduler(None, budget=64), make_scheduler(None, budget=32)
    for sched in (wide, narrow):
        sched.add_request(make_request("r", 48, max_tokens=4))
    out = wide.schedule()
    assert out.total_num_scheduled_tokens == 48
    SimulatedRunner(wide).execute(out)
    with pytest.raises(BudgetInvariantError, match=r"max_num_batched_tokens=32"):
        SimulatedRunner(narrow).execute(out)


def test_the_vllm_comparison_knows_every_method_and_refuses_an_unknown_one() -> None:
    """benchmarks/vllm_rules.py's reservation S: every registered method has one (a new
    method must add it), and an unknown method is refused instead of costing 0."""
    from benchmarks.vllm_rules import per_request_reservation
    from spec_decode import methods

    assert {m: per_request_reservation(m, 4) for m in METHODS} == {
        "dflash": 5, "draft_model": 1, "eagle": 0, "mtp": 0, "ngram": 0, "parallel": 3,
        "pard": 4, "suffix": 0}

    class Unknown(methods.SpecMethod):
        name = "unknown-to-vllm"

    refused = pytest.raises(ValueError, match="no vLLM reservation S is known for method "
                                              "'unknown-to-vllm'")
    with methods.registered(Unknown), refused:
        per_request_reservation("unknown-to-vllm", 4)
