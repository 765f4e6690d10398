"""The scheduler's bulk plan decides exactly what its reference does.

- `plan_bulk` (numpy, the whole running set at once) against
  `plan_chunk` called request by request, on random running sets, budgets, KV pools
  and rules of every method (tests below draw them with hypothesis);
- whole schedulers with and without the bulk plan, step by step on random workloads
  (arrivals, priorities, tight KV pools that preempt, aborts, stop tokens), must
  produce equal `SchedulerOutput`s and equal engine outputs;
- the bulk token append and the bulk acceptance counts against their one-by-one forms.

Each comparison is shown to fail on a deliberately broken bulk plan (a rule whose
tables, the bulk plan's only input besides the shared k rule, are wrong).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runner.simulated import SimulatedRunner
from scheduler import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.budget import ChunkPlan, RequestView, ThrottleRule, plan_chunk
from scheduler.bulk_plan import RunningCounters, plan_bulk
from scheduler.request import NUM_OUTCOMES, RequestStatus
from scheduler.stats import SpecDecodingStats
from scheduler.step_record import StepRecord
from scheduler.update import _append_one_by_one, append_tokens
from spec_decode import METHODS, SpeculativeConfig
from spec_decode.methods import get_method

BLOCK = 4
HUGE = 1 << 30


@dataclass
class FakeRunning:
    """The counters `RunningCounters` holds, without a scheduler around them."""

    computed: int
    tokens: int
    spec: int
    output: int
    max_tokens: int
    blocks: int
    drafter_computed: int = -1  # -1: level with computed
    reached: int = 0
    accepted: int = 0
    last_outcome: int = 0


def _rule(method: str | None, k: int, adaptive: bool, max_model_len: int) -> ThrottleRule:
    return ThrottleRule(get_method(method) if method else None, k, max_model_len, adaptive)


def reference_run(rule: ThrottleRule, reqs: list[FakeRunning], remaining: list[int],
                  free_blocks: int, threshold: int) -> list[ChunkPlan]:
    """`plan_chunk` request by request: the leading requests that get the chunk they
    would get with an unlimited budget, while their new KV blocks fit the pool."""
    plans = []
    remaining = list(remaining)
    for r in reqs:
        view = RequestView(r.computed, r.tokens, r.spec, r.output, r.max_tokens,
                           num_drafter_computed=_drafter(r))
        pending = r.tokens + r.spec - r.computed
        max_chunk = min(pending, threshold) if threshold else pending
        plan = plan_chunk(rule, remaining, view, max_chunk, allow_partial=True)
        unlimited = plan_chunk(rule, [HUGE] * rule.num_passes, view, max_chunk, True)
        new_blocks = max(-(-(r.computed + plan.num_tokens + plan.lookahead) // BLOCK)
                         - r.blocks, 0) if plan else 0
        if plan is None or plan != unlimited or new_blocks > free_blocks:
            break
        plans.append(plan)
        remaining = [rem - row for rem, row in zip(remaining, plan.rows)]
        free_blocks -= new_blocks
    return plans


def _drafter(r: FakeRunning) -> int:
    return r.computed if r.drafter_computed < 0 else r.drafter_computed


def planned(rule: ThrottleRule, reqs: list[FakeRunning], remaining: list[int],
            free_blocks: int, threshold: int) -> list[ChunkPlan]:
    def column(field: str) -> np.ndarray:
        return np.array([getattr(r, field) for r in reqs], dtype=np.int64)

    counters = RunningCounters(
        *(column(f) for f in ("computed", "tokens", "spec", "output", "max_tokens", "blocks")),
        np.array([_drafter(r) for r in reqs], dtype=np.int64),
        *(column(f) for f in ("accepted", "last_outcome")), column("output"),
        np.zeros((len(reqs), NUM_OUTCOMES), dtype=np.int64) + column("reached")[:, None])
    record = StepRecord(rule, 0, len(reqs))
    record.remaining = list(remaining)
    count = plan_bulk(record, reqs, counters, free_blocks, BLOCK,  # type: ignore[arg-type]
                      threshold)
    assert count == record.count
    assert record.remaining == [rem - sum(p.rows[i] for p in record.plans())
                                for i, rem in enumerate(remaining)]
    return record.plans()


@st.composite
def running_sets(draw: st.DrawFn) -> tuple:
    method = draw(st.sampled_from([None, *METHODS]))
    k = draw(st.integers(1, 8))
    max_model_len = draw(st.integers(16, 200))
    rule = _rule(method, k, draw(st.booleans()), max_model_len)
    reqs = []
    for _ in range(draw(st.integers(1, 12))):
        tokens = draw(st.integers(2, max_model_len - 1))
        prompt = draw(st.integers(1, tokens))
        output = tokens - prompt
        # Decoding (one token pending) most of the time, some mid-prefill.
        computed = draw(st.one_of(st.just(tokens - 1), st.integers(0, tokens - 1)))
        spec = draw(st.integers(0, k)) if computed == tokens - 1 else 0
        max_tokens = draw(st.integers(max(output, 1), output + 64))
        blocks = draw(st.integers(0, -(-computed // BLOCK) + 2))
        # A decoding request's drafter may be a few rows behind (parked before).
        behind = (draw(st.integers(0, min(computed, 6)))
                  if rule.parks and computed == tokens - 1 else 0)
        reqs.append(FakeRunning(computed, tokens, spec, output, max_tokens, blocks,
                                computed - behind))
    remaining = [draw(st.integers(0, 60)) for _ in range(rule.num_passes)]
    return rule, reqs, remaining, draw(st.integers(0, 30)), draw(st.sampled_from([0, 1, 3, 8]))


@settings(max_examples=300)
@given(running_sets())
def test_bulk_matches_plan_chunk(case: tuple) -> None:
    rule, reqs, remaining, free_blocks, threshold = case
    assert rule.tables is not None
    assert planned(rule, reqs, remaining, free_blocks, threshold) == \
        reference_run(rule, reqs, remaining, free_blocks, threshold)


class BrokenTables(ThrottleRule):
    """A rule whose tables (what the bulk plan charges from) are wrong one way; its
    `plan` (what `plan_chunk` charges from) is left right."""

    def __init__(self, rule: ThrottleRule, how: str) -> None:
        super().__init__(rule.method, rule.max_k, rule.max_model_len, rule.adaptive)
        self.how = how

    @property  # type: ignore[override]
    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tables = ThrottleRule.tables.func(self)  # type: ignore[attr-defined]
        ctx, base, lookahead = tables
        if self.how == "rows_of_next_k":  # charges the rows of k + 1 drafts
            base = np.vstack([base[1:], base[-1:]])
        elif self.how == "no_lookahead":  # forgets the drafter's KV slots past the chunk
            lookahead = np.zeros_like(lookahead)
        elif self.how == "context_in_every_pass":  # n rows in passes without context
            ctx = np.ones_like(ctx)
        return ctx, base, lookahead


BREAKS = ["rows_of_next_k", "no_lookahead", "context_in_every_pass"]


@pytest.mark.parametrize("how", BREAKS)
def test_broken_bulk_plan_is_caught(how: str) -> None:
    """Each break changes the decision on this decoding set; the comparison sees it.
    (k is no break of the bulk plan: both deciders call the one `ThrottleRule.k`.)"""
    rule = _rule("dflash", 4, False, 60)
    reqs = [FakeRunning(c, c + 1, 4, 10, 200, -(-c // BLOCK)) for c in (15, 31, 54)]
    budget = [60] * rule.num_passes
    reference = reference_run(rule, reqs, budget, 30, 3)
    assert planned(rule, reqs, budget, 30, 3) == reference
    assert planned(BrokenTables(rule, how), reqs, budget, 30, 3) != reference
    # The threshold is the scheduler's, passed in: a bulk plan that ignored it differs.
    assert planned(rule, reqs, budget, 30, 0) != reference


# ---- whole schedulers, with and without the bulk plan -----------------------------


def _schedulers(method: str | None, k: int, policy: str, num_blocks: int, chunked: bool,
                threshold: int, adaptive: bool, budget: int) -> list[Scheduler]:
    spec = SpeculativeConfig(method, k, draft_policy="fit" if adaptive else "fixed") \
        if method else None
    pair = [Scheduler(SchedulerConfig(budget, 6, 128, chunked, policy,
                                      long_prefill_token_threshold=threshold),
                      CacheConfig(block_size=BLOCK, num_blocks=num_blocks), spec)
            for _ in range(2)]
    pair[1].plan_in_bulk = False  # the reference: every request through plan_chunk
    return pair


def replay_pair(scheds: list[Scheduler], seed: int, steps: int) -> int:
    """Drive both schedulers through one random workload; return steps that ran a
    bulk run. Fails at the first step where their outputs differ."""
    rng = random.Random(seed)
    runners = [SimulatedRunner(s, vocab_size=40, acceptance=0.6,
                                             eos_token_id=2, eos_prob=0.02, seed=seed)
               for s in scheds]
    bulk_steps, next_id = 0, 0
    for step in range(steps):
        if rng.random() < 0.5:
            prompt = [3 + rng.randrange(30) for _ in range(rng.randint(1, 60))]
            params = SamplingParams(max_tokens=rng.randint(1, 40),
                                    stop_token_ids=(rng.randrange(3, 40),) if rng.random()
                                    < 0.2 else ())
            priority = rng.randrange(3)
            for sched in scheds:  # a refusal hits both alike; the outputs check it
                with contextlib.suppress(ValueError):
                    sched.add_request(Request(f"r{next_id}", prompt, params, 2, priority,
                                              float(next_id)))
            next_id += 1
        if rng.random() < 0.05 and scheds[0].requests:
            victim = rng.choice(sorted(scheds[0].requests))
            for sched in scheds:
                sched.abort_request(victim)
        outs = [sched.schedule() for sched in scheds]
        assert outs[0] == outs[1], f"step {step}: schedules differ"
        bulk_steps += outs[0].num_reqs > len(outs[0].scheduled_new_reqs) and \
            scheds[0].plan_in_bulk
        results = [runner.execute(out) for runner, out in zip(runners, outs)]
        updates = [s.update_from_output(o, r) for s, o, r in zip(scheds, outs, results)]
        assert updates[0] == updates[1], f"step {step}: updates differ"
        assert {r: q.num_computed_tokens for r, q in scheds[0].requests.items()} == \
            {r: q.num_computed_tokens for r, q in scheds[1].requests.items()}
        for sched in scheds:
            sched.kv.pool.check_integrity()
    return bulk_steps


@settings(max_examples=40, deadline=None)
@given(method=st.sampled_from([None, *METHODS]), k=st.integers(1, 5),
       policy=st.sampled_from(["fcfs", "priority"]), num_blocks=st.sampled_from([40, 400]),
       chunked=st.booleans(), threshold=st.sampled_from([0, 2, 16]),
       adaptive=st.booleans(), extra=st.sampled_from([0, 8, 64]), seed=st.integers(0, 999))
def test_schedulers_with_and_without_bulk_plan_agree(
        method: str | None, k: int, policy: str, num_blocks: int, chunked: bool,
        threshold: int, adaptive: bool, extra: int, seed: int) -> None:
    budget = (2 * k + 2 if method else 1) + extra
    budget = budget if chunked else max(budget, 128)
    scheds = _schedulers(method, k, policy, num_blocks, chunked, threshold, adaptive, budget)
    replay_pair(scheds, seed, 120)


def test_whole_scheduler_comparison_catches_a_broken_bulk_plan() -> None:
    scheds = _schedulers("parallel", 4, "fcfs", 400, True, 0, False, 64)
    scheds[0].rule = BrokenTables(scheds[0].rule, "rows_of_next_k")
    with pytest.raises(AssertionError, match="schedules differ"):
        replay_pair(scheds, 7, 200)


def test_bulk_plan_takes_the_decoding_run() -> None:
    """Not vacuous: with room for everyone, the bulk plan covers the running set."""
    scheds = _schedulers("ngram", 3, "fcfs", 400, True, 0, False, 256)
    assert replay_pair(scheds, 3, 80) > 20


# ---- bulk update pieces --------------------------------------------------------------


@settings(max_examples=300)
@given(sampled=st.lists(st.integers(0, 9), min_size=0, max_size=6),
       num_output=st.integers(0, 20), prompt=st.integers(1, 20),
       max_tokens=st.integers(1, 30), min_tokens=st.integers(0, 5),
       stop=st.lists(st.integers(0, 9), max_size=2), ignore_eos=st.booleans(),
       max_model_len=st.integers(2, 60))
def test_append_tokens_equals_one_by_one(sampled: list[int], num_output: int, prompt: int,
                                         max_tokens: int, min_tokens: int, stop: list[int],
                                         ignore_eos: bool, max_model_len: int) -> None:
    max_tokens = max(max_tokens, num_output + 1, min_tokens)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                            stop_token_ids=tuple(stop), ignore_eos=ignore_eos)
    pair = []
    for append in (append_tokens, _append_one_by_one):
        req = Request("r", list(range(prompt)), params, eos_token_id=2)
        req.output_token_ids = list(range(num_output))
        req.all_token_ids = req.prompt_token_ids + req.output_token_ids
        status = append(req, list(sampled), max_model_len)
        pair.append((status, req.output_token_ids, req.all_token_ids, req.stop_token_id))
    assert pair[0] == pair[1]


def test_append_tokens_stops_inside_the_drafts() -> None:
    req = Request("r", [5, 6], SamplingParams(max_tokens=10, stop_token_ids=(7,)), 2)
    assert append_tokens(req, [8, 7, 9], 100) == RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [8, 7]


@settings(max_examples=100)
@given(st.lists(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8)), max_size=12),
                max_size=4))
def test_record_many_counts_every_position(steps: list[list[tuple[int, int]]]) -> None:
    """Against counts taken draft by draft, position by position."""
    stats = SpecDecodingStats()
    drafts_at, accepted_at = [0] * 8, [0] * 8
    for pairs in steps:
        pairs = [(v, min(a, v)) for v, a in pairs]
        stats.record_many([v for v, _ in pairs], [a for _, a in pairs])
        for v, a in pairs:
            for pos in range(v):
                drafts_at[pos] += 1
                accepted_at[pos] += pos < a
    width = len(stats.num_draft_tokens_per_pos)
    assert stats.num_draft_tokens_per_pos == drafts_at[:width]
    assert stats.num_accepted_tokens_per_pos == accepted_at[:width]
    assert not any(drafts_at[width:])
    assert stats.num_drafts == sum(len(p) for p in steps)
