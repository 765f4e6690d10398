"""Property-based scheduler test: a hypothesis state machine per speculative method.

One machine per registered method (spec_decode.methods), plus speculation off.
Random arrivals, aborts (also between schedule and update), random acceptance and
tight KV pools drive the real Scheduler against the SimulatedRunner, which builds
every forward pass's rows from its own reading of the cost table and asserts
built == declared. After every step we check the budget, the k rule, progress and
block-pool integrity; at the end every request must finish and the pool be free.
"""

from __future__ import annotations

import unittest

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.simulate import synthetic_step_time
from runner.simulated import SimulatedRunner
from scheduler import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig
from spec_decode import DRAFT_POLICIES, SpeculativeConfig, min_decode_rows
from spec_decode.methods import method_names

NO_EXTRA_ROWS = ("ngram", "suffix", "eagle", "mtp")
BLOCK_SIZE = 4
MAX_MODEL_LEN = 96
# The burst: requests that cannot all fit a tight pool at once, so preemption must occur.
BURST = 3
BURST_PROMPT = 6
BURST_MAX_TOKENS = 48


def expected_k(max_k: int, req: Request, n: int, s: int, computed_before: int) -> int:
    """DESIGN.md §2's k rule, restated independently of scheduler/budget.py."""
    if computed_before + n < req.num_tokens:
        return 0
    return max(0, min(max_k, MAX_MODEL_LEN - (req.num_tokens + s + 2),
                      req.max_tokens - (req.num_output_tokens + s) - 2))


class SchedulerMachine(RuleBasedStateMachine):
    method: str | None = None

    @initialize(
        k=st.integers(1, 6), extra_budget=st.sampled_from([0, 1, 3, 8, 24, 64]),
        tight=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
        chunked=st.booleans(), acceptance=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
        max_num_seqs=st.integers(2, 8), empty_proposer=st.booleans(), seed=st.integers(0, 99),
        draft_policy=st.sampled_from(DRAFT_POLICIES),
    )
    def setup(self, k: int, extra_budget: int, tight: bool, policy: str, chunked: bool,
              acceptance: float, max_num_seqs: int, empty_proposer: bool, seed: int,
              draft_policy: str) -> None:
        method = self.method
        self.adaptive = draft_policy == "fit"
        self.goodput = draft_policy == "goodput"
        spec = SpeculativeConfig(method, k, draft_policy=draft_policy) if method else None
        self.max_k = k if method else 0
        budget = (max(min_decode_rows(spec).values()) if spec else 1) + extra_budget
        if not chunked:
            budget = max(budget, MAX_MODEL_LEN)
        if tight:
            # Room for two burst requests at once, or they would run one at a time.
            budget = max(budget, 4 * budget + BURST_PROMPT)
        self.budget = budget
        # Tight: just over one request's worst-case footprint.
        num_blocks = 20 if tight else 400
        self.tight = tight
        sched_cfg = SchedulerConfig(budget, max_num_seqs, MAX_MODEL_LEN, chunked, policy)
        # Shadow: the same run with speculation off must schedule identically when the
        # method adds no rows and proposes nothing. eagle/mtp hold k - 1 lookahead slots
        # for their drafter's KV, so the pool must not bind, and prefix caching must be
        # off: the extra blocks change which free cached blocks get evicted, hence hits.
        # Nor may a drafter park and resume: goodput parks a request it gives k = 0,
        # and when it drafts again its drafter replays the skipped rows, rows that off
        # does not have (found: mtp, a prompt of 83 and one of 13 in one step).
        resumes = spec is not None and spec.parks and self.goodput
        shadow = empty_proposer and method in NO_EXTRA_ROWS and not resumes and (
            method in ("ngram", "suffix") or not tight)
        cache_cfg = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks,
                                enable_prefix_caching=not (shadow and method in ("eagle", "mtp")))
        self.sched = Scheduler(sched_cfg, cache_cfg, spec)
        propose = (lambda rid, n: []) if empty_proposer else None
        # The runner re-derives the k rule and bounds rows in their KV slots, as the
        # model runner does: the scheduler must satisfy both on every step.
        self.runner = SimulatedRunner(
            self.sched, vocab_size=50, acceptance=acceptance, eos_token_id=2, eos_prob=0.03,
            seed=seed, propose=propose, step_time=synthetic_step_time(0.02, 0.0003))
        self.shadow: tuple[Scheduler, SimulatedRunner] | None = None
        if shadow:
            plain = Scheduler(sched_cfg, cache_cfg, None)
            self.shadow = (plain, SimulatedRunner(plain, vocab_size=50, acceptance=acceptance,
                                                  eos_token_id=2, eos_prob=0.03, seed=seed))
        self.all_requests: dict[str, Request] = {}
        self.protected: set[str] = set()
        self.next_id = 0
        if tight:
            for _ in range(BURST):
                rid = self._add(BURST_PROMPT, BURST_MAX_TOKENS, 0, ignore_eos=True)
                assert rid is not None
                self.protected.add(rid)

    def _add(self, prompt_len: int, max_tokens: int, priority: int,
             ignore_eos: bool = False) -> str | None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = [3 + (self.next_id * 7 + i) % 40 for i in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        schedulers = [self.sched] + ([self.shadow[0]] if self.shadow else [])
        results = []
        for sched in schedulers:
            req = Request(rid, prompt, params, eos_token_id=2, priority=priority,
                          arrival_time=float(self.next_id))
            try:
                sched.add_request(req)
                results.append(req)
            except ValueError as err:
                assert "KV blocks" in str(err) or "max_model_len" in str(err), err
                results.append(None)
        if results[0] is None:
            if len(results) > 1 and results[1] is not None:
                # The +K lookahead footprint refused it here only; keep shadow in step.
                schedulers[1].abort_request(rid)
            return None
        self.all_requests[rid] = results[0]
        return rid

    @rule(prompt_len=st.integers(1, MAX_MODEL_LEN + 4), max_tokens=st.integers(1, 40),
          priority=st.integers(0, 3))
    def add_request(self, prompt_len: int, max_tokens: int, priority: int) -> None:
        before = len(self.sched.requests)
        rid = self._add(prompt_len, max_tokens, priority)
        assert len(self.sched.requests) == before + (rid is not None)

    def _abortable(self) -> list[str]:
        return sorted(set(self.sched.requests) - self.protected)

    @precondition(lambda self: bool(self._abortable()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._abortable()))
        self._abort(rid)

    def _abort(self, rid: str, shadow: bool = True) -> None:
        self.sched.abort_request(rid)
        if self.shadow and shadow:
            self.shadow[0].abort_request(rid)
        assert rid not in self.sched.requests
        assert self.all_requests[rid].is_finished()

    @rule()
    def step(self) -> None:
        self._step()

    @rule(closed=st.booleans())
    def close_arrivals(self, closed: bool) -> None:
        """An offline caller says nobody joins (goodput then plans to finish the batch);
        the state machine adds requests anyway: the flag steers k, never the invariants."""
        self.sched.arrivals_closed = closed

    @precondition(lambda self: bool(self._abortable()))
    @rule(data=st.data())
    def abort_mid_step(self, data: st.DataObject) -> None:
        """Abort a request after schedule() and before update_from_output()."""
        rid = data.draw(st.sampled_from(self._abortable()))
        self._step(abort=rid)

    @precondition(lambda self: self.shadow is None and self.sched.has_unfinished_requests())
    @rule(data=st.data())
    def failed_step(self, data: st.DataObject) -> None:
        """The runner fails a step: as EngineCore does, its requests are requeued for
        recompute, some as suspects; they must still all run, one suspect at a time."""
        before = {rid: (r.num_computed_tokens, r.num_tokens)
                  for rid, r in self.sched.requests.items()}
        out = self.sched.schedule()
        self._check_output(out, True, before)
        for rid in reversed(list(out.num_scheduled_tokens)):
            self.sched.requeue(rid, suspect=data.draw(st.booleans()))

    def _step(self, abort: str | None = None) -> None:
        had_work = self.sched.has_unfinished_requests()
        before = {rid: (r.num_computed_tokens, r.num_tokens)
                  for rid, r in self.sched.requests.items()}
        out = self.sched.schedule()
        self._check_output(out, had_work, before)
        if abort is not None:
            self._abort(abort, shadow=False)  # the shadow aborts after its own schedule()
        result = self.runner.execute(out)  # asserts built == declared, every pass <= B
        self._check_positions()
        self._check_room(result)
        self.sched.update_from_output(out, result)
        if self.shadow:
            self._step_shadow(out, abort)

    def _check_output(self, out, had_work: bool, before) -> None:  # type: ignore[no-untyped-def]
        assert out.total_num_scheduled_tokens == out.pass_rows["target"]
        for name, rows in out.pass_rows.items():
            assert rows <= self.budget, (name, rows, self.budget)
        assert out.num_drafter_tokens == max(
            (rows for name, rows in out.pass_rows.items() if name != "target"), default=0)
        if had_work:
            assert out.total_num_scheduled_tokens > 0, "no progress with runnable requests"
        for req in self.sched.running:  # what admission promised (Scheduler.max_slots)
            longest = min(MAX_MODEL_LEN, req.num_prompt_tokens + req.max_tokens) - 1
            held = len(self.sched.kv.req_blocks.get(req.request_id, ()))
            assert held <= -(-longest // BLOCK_SIZE), (req, held, longest)
        suspects = [r for r in self.sched.running if r.suspect]
        assert len(suspects) <= 1, suspects  # so a repeated fault names its request
        assert len(self.sched.running) <= self.sched.config.max_num_seqs
        for rid, n in out.num_scheduled_tokens.items():
            assert n >= 1
            req = self.sched.requests[rid]
            s = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            computed_before = req.num_computed_tokens - n
            if rid in before:
                assert before[rid][0] in (computed_before, 0) or req.num_preemptions
            k = out.num_draft_tokens.get(rid, 0)
            rule_k = expected_k(self.max_k, req, n, s, computed_before)
            if rid in out.adapted_draft_tokens:
                # Only the adaptive policy cuts k, or a parked request whose catch-up
                # rows do not fit parks again (k = 0).
                assert k < out.adapted_draft_tokens[rid] <= rule_k
                assert out.adapted_draft_tokens[rid] == rule_k or self.goodput
                assert self.adaptive or (k == 0 and self.sched.rule.parks), (rid, k, rule_k)
            elif self.goodput:  # the policy caps k, never past the rule
                assert k <= rule_k, (rid, n, s, k, rule_k)
            else:
                assert k == rule_k, (rid, n, s, k, rule_k)

    def _check_room(self, result) -> None:  # type: ignore[no-untyped-def]
        """The worst case the k rule guards: every token a step emits fits within
        max_model_len and max_tokens, so none is ever dropped for length."""
        for rid, sampled in zip(result.req_ids, result.sampled_token_ids, strict=True):
            req = self.sched.requests.get(rid)
            if req is None:
                continue  # aborted mid-step
            room = min(MAX_MODEL_LEN - req.num_tokens, req.max_tokens - req.num_output_tokens)
            assert len(sampled) <= room, (rid, len(sampled), room)

    def _check_positions(self) -> None:
        step = self.runner.last_step
        assert step is not None
        assert step.max_position() < MAX_MODEL_LEN

    def _step_shadow(self, out, abort: str | None) -> None:  # type: ignore[no-untyped-def]
        assert self.shadow is not None
        sched, runner = self.shadow
        shadow_out = sched.schedule()
        if abort is not None:
            sched.abort_request(abort)
        assert shadow_out.num_scheduled_tokens == out.num_scheduled_tokens
        assert shadow_out.preempted_req_ids == out.preempted_req_ids
        sched.update_from_output(shadow_out, runner.execute(shadow_out))

    @invariant()
    def pool_consistent(self) -> None:
        if hasattr(self, "sched"):
            self.sched.kv.pool.check_integrity()

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        steps = 0
        while self.sched.has_unfinished_requests():
            self._step()
            self.sched.kv.pool.check_integrity()
            steps += 1
            assert steps < 5000, "requests did not drain"
        assert all(req.is_finished() for req in self.all_requests.values())
        assert self.sched.kv_cache_usage() == 0.0
        assert self.sched.kv.pool.num_free_blocks == self.sched.cache_config.num_blocks
        assert not self.sched.running and not len(self.sched.waiting)
        if self.tight:
            assert self.sched.stats.num_preemptions > 0, "tight pool never preempted"


def _machine_for(method: str | None) -> type[unittest.TestCase]:
    machine = type(f"Machine_{method}", (SchedulerMachine,), {"method": method})
    return machine.TestCase  # type: ignore[attr-defined,no-any-return]


TestSpecOff = _machine_for(None)
# One machine per registered method, under a stable name pytest collects: a method
# added to the registry is tested here without editing this file.
for _method in method_names():
    globals()[f"TestStateMachine_{_method}"] = _machine_for(_method)
