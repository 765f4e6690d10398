"""Scheduler request lifecycle: stopping, aborting, refusing, chunking, ordering,
preemption, draft rollback and prefix caching, driven by the SimulatedRunner."""

from __future__ import annotations

import math

import pytest

from runner.simulated import SimulatedRunner
from scheduler import ModelRunnerOutput, Request, RequestStatus, SamplingParams, Scheduler
from tests.helpers import drain, make_request, make_scheduler, run_step

EOS = 2  # make_request's eos_token_id


def _assert_idle_and_clean(scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished_requests()
    assert scheduler.running == []
    assert len(scheduler.waiting) == 0
    assert scheduler.kv_cache_usage() == 0.0
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks
    assert scheduler.kv.req_blocks == {}
    scheduler.kv.pool.check_integrity()


def _req(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0,
         arrival: float = 0.0, first_token: int = 10) -> Request:
    prompt = [first_token + i for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=EOS, priority=priority, arrival_time=arrival)


def _drain_recording(scheduler: Scheduler, runner: SimulatedRunner, max_steps: int = 2000):
    """Drain, returning every step's SchedulerOutput."""
    outputs = []
    while scheduler.has_unfinished_requests():
        out, _ = run_step(scheduler, runner)
        scheduler.kv.pool.check_integrity()
        outputs.append(out)
        assert len(outputs) < max_steps, "no progress"
    return outputs


# ---- stopping ------------------------------------------------------------------


def test_stops_on_eos() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 8, max_tokens=50)
    scheduler.add_request(request)
    drain(scheduler, SimulatedRunner(scheduler, eos_token_id=EOS, eos_prob=1.0))
    assert request.output_token_ids == [EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.finish_reason == "stop"
    assert request.stop_token_id is None
    _assert_idle_and_clean(scheduler)


def test_ignore_eos_runs_to_max_tokens() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 8, max_tokens=7, ignore_eos=True)
    scheduler.add_request(request)
    drain(scheduler, SimulatedRunner(scheduler, eos_token_id=EOS, eos_prob=1.0))
    assert request.output_token_ids == [EOS] * 7
    assert request.finish_reason == "length"
    _assert_idle_and_clean(scheduler)


def test_no_eos_id_never_stops_on_token_2() -> None:
    scheduler = make_scheduler()
    request = Request("a", [5, 6, 7], SamplingParams(max_tokens=4), eos_token_id=None)
    scheduler.add_request(request)
    drain(scheduler, SimulatedRunner(scheduler, eos_token_id=EOS, eos_prob=1.0))
    assert len(request.output_token_ids) == 4
    assert request.finish_reason == "length"


def test_stops_on_stop_token_id() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 8, max_tokens=50, stop_token_ids=(77,))
    scheduler.add_request(request)
    drain(scheduler, SimulatedRunner(scheduler, eos_token_id=77, eos_prob=1.0))
    assert request.output_token_ids == [77]
    assert request.stop_token_id == 77
    assert request.finish_reason == "stop"
    _assert_idle_and_clean(scheduler)


def test_stop_token_ignored_before_min_tokens() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 8, max_tokens=50, stop_token_ids=(77,), min_tokens=3)
    scheduler.add_request(request)
    drain(scheduler, SimulatedRunner(scheduler, eos_token_id=77, eos_prob=1.0))
    assert request.output_token_ids == [77, 77, 77]
    assert request.finish_reason == "stop"


def test_eos_inside_accepted_drafts_drops_the_rest() -> None:
    scheduler = make_scheduler("ngram", k=4)
    request = make_request("a", 8, max_tokens=50)
    scheduler.add_request(request)
    runner = SimulatedRunner(scheduler, acceptance=1.0, vocab_size=1000,
                             propose=lambda rid, k: [EOS] * k)
    drain(scheduler, runner)
    # Step 1 samples one token and proposes EOS drafts; step 2 accepts the first one.
    assert len(request.output_token_ids) == 2
    assert request.output_token_ids[-1] == EOS
    assert request.finish_reason == "stop"
    _assert_idle_and_clean(scheduler)


@pytest.mark.parametrize("method", [None, "ngram", "eagle", "pard", "dflash", "draft_model"])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9, 17])
def test_stops_at_exactly_max_tokens_with_all_drafts_accepted(method: str | None,
                                                              max_tokens: int) -> None:
    scheduler = make_scheduler(method, k=4)
    request = make_request("a", 6, max_tokens=max_tokens, ignore_eos=True)
    scheduler.add_request(request)
    runner = SimulatedRunner(scheduler, acceptance=1.0, seed=max_tokens)
    steps = 0
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)
        steps += 1
        assert len(request.output_token_ids) <= max_tokens
        assert steps < 100
    assert len(request.output_token_ids) == max_tokens
    assert request.finish_reason == "length"
    if method is not None and max_tokens >= 9:
        assert scheduler.stats.num_accepted_drafts > 0
        assert steps < max_tokens  # drafts really sped it up
    _assert_idle_and_clean(scheduler)


@pytest.mark.parametrize("method", [None, "ngram", "pard", "dflash", "parallel", "eagle"])
def test_never_exceeds_max_model_len(method: str | None) -> None:
    max_len = 40
    scheduler = make_scheduler(method, k=4, max_model_len=max_len)
    request = make_request("a", 25, max_tokens=100, ignore_eos=True)
    scheduler.add_request(request)
    runner = SimulatedRunner(scheduler, acceptance=1.0)
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)
        assert request.num_tokens <= max_len
        # No row of any pass (target, drafter, mask/query rows) sits at or past the limit.
        assert runner.last_step is not None
        assert runner.last_step.max_position() < max_len
    assert request.num_tokens == max_len
    assert request.finish_reason == "length"
    _assert_idle_and_clean(scheduler)


def test_prompt_one_short_of_max_model_len_gets_one_token() -> None:
    scheduler = make_scheduler("pard", k=4, max_model_len=32)
    request = make_request("a", 31, max_tokens=10, ignore_eos=True)
    scheduler.add_request(request)
    out, _ = run_step(scheduler, SimulatedRunner(scheduler, acceptance=1.0))
    assert out.num_draft_tokens.get("a", 0) == 0  # no room for any draft
    assert len(request.output_token_ids) == 1
    assert request.finish_reason == "length"


def test_finished_ids_reported_once_in_next_output() -> None:
    scheduler = make_scheduler()
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("short", 4, max_tokens=1, ignore_eos=True))
    scheduler.add_request(make_request("long", 4, max_tokens=5, ignore_eos=True))
    first, _ = run_step(scheduler, runner)
    assert first.finished_req_ids == set()
    second, _ = run_step(scheduler, runner)
    assert second.finished_req_ids == {"short"}
    third, _ = run_step(scheduler, runner)
    assert "short" not in third.finished_req_ids


# ---- aborts --------------------------------------------------------------------


def test_abort_waiting_request() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner = SimulatedRunner(scheduler)
    running = make_request("run", 8, max_tokens=4, ignore_eos=True)
    waiting = make_request("wait", 8, max_tokens=4, ignore_eos=True)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler, runner)
    assert waiting.status == RequestStatus.WAITING
    scheduler.abort_request("wait")
    assert waiting.status == RequestStatus.FINISHED_ABORTED
    assert waiting.finish_reason == "abort"
    assert "wait" not in scheduler.requests
    out, _ = run_step(scheduler, runner)
    assert "wait" in out.finished_req_ids
    assert "wait" not in out.num_scheduled_tokens
    drain(scheduler, runner)
    assert len(running.output_token_ids) == 4
    _assert_idle_and_clean(scheduler)


@pytest.mark.parametrize("method", [None, "pard", "dflash"])
def test_abort_running_request_mid_decode(method: str | None) -> None:
    scheduler = make_scheduler(method, k=3)
    runner = SimulatedRunner(scheduler, acceptance=0.5)
    victim = make_request("victim", 30, max_tokens=40, ignore_eos=True)
    other = make_request("other", 30, max_tokens=10, ignore_eos=True, first_token=300)
    scheduler.add_request(victim)
    scheduler.add_request(other)
    for _ in range(3):
        run_step(scheduler, runner)
    assert victim.status == RequestStatus.RUNNING
    assert scheduler.kv_cache_usage() > 0
    scheduler.abort_request("victim")
    assert victim.spec_token_ids == []
    assert "victim" not in scheduler.kv.req_blocks
    scheduler.kv.pool.check_integrity()
    out, _ = run_step(scheduler, runner)
    assert "victim" in out.finished_req_ids
    assert "victim" not in out.num_scheduled_tokens
    drain(scheduler, runner)
    assert len(other.output_token_ids) == 10
    _assert_idle_and_clean(scheduler)


@pytest.mark.parametrize("method", [None, "eagle", "pard"])
def test_abort_between_schedule_and_update(method: str | None) -> None:
    scheduler = make_scheduler(method, k=2)
    runner = SimulatedRunner(scheduler, acceptance=0.5)
    victim = make_request("victim", 10, max_tokens=30, ignore_eos=True)
    other = make_request("other", 10, max_tokens=6, ignore_eos=True, first_token=200)
    scheduler.add_request(victim)
    scheduler.add_request(other)
    run_step(scheduler, runner)
    out = scheduler.schedule()
    assert "victim" in out.num_scheduled_tokens
    scheduler.abort_request("victim")
    result = runner.execute(out)
    scheduler.update_from_output(out, result)  # must skip the aborted request
    assert victim.status == RequestStatus.FINISHED_ABORTED
    assert "victim" not in scheduler.requests
    scheduler.kv.pool.check_integrity()
    nxt, _ = run_step(scheduler, runner)
    assert "victim" in nxt.finished_req_ids
    drain(scheduler, runner)
    assert len(other.output_token_ids) == 6
    _assert_idle_and_clean(scheduler)


def test_abort_every_request_right_after_admission() -> None:
    scheduler = make_scheduler()
    runner = SimulatedRunner(scheduler)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 20, first_token=10 + 40 * i))
    out = scheduler.schedule()
    assert scheduler.kv_cache_usage() > 0
    for i in range(5):
        scheduler.abort_request(f"r{i}")
    scheduler.update_from_output(out, runner.execute(out))
    nxt = scheduler.schedule()
    assert nxt.finished_req_ids == {f"r{i}" for i in range(5)}
    assert nxt.num_scheduled_tokens == {}
    _assert_idle_and_clean(scheduler)


def test_abort_preempted_request_frees_everything() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=8)
    runner = SimulatedRunner(scheduler)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=12, ignore_eos=True,
                                           first_token=10 + 50 * i))
    preempted = None
    for _ in range(50):
        out, _ = run_step(scheduler, runner)
        if out.preempted_req_ids:
            preempted = next(iter(out.preempted_req_ids))
            break
    assert preempted is not None
    assert scheduler.requests[preempted].status == RequestStatus.PREEMPTED
    scheduler.abort_request(preempted)
    nxt, _ = run_step(scheduler, runner)
    assert preempted in nxt.finished_req_ids
    drain(scheduler, runner)
    _assert_idle_and_clean(scheduler)


def test_abort_unknown_or_finished_id_is_a_no_op() -> None:
    scheduler = make_scheduler()
    runner = SimulatedRunner(scheduler)
    request = make_request("a", 4, max_tokens=2, ignore_eos=True)
    scheduler.add_request(request)
    scheduler.abort_request("nope")
    assert scheduler.requests == {"a": request}
    drain(scheduler, runner)
    assert scheduler.schedule().finished_req_ids == {"a"}
    scheduler.abort_request("a")  # already finished
    assert request.finish_reason == "length"
    out = scheduler.schedule()
    assert out.finished_req_ids == set()  # reported once, never again as an abort
    _assert_idle_and_clean(scheduler)


def test_request_id_reusable_after_abort() -> None:
    scheduler = make_scheduler()
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 8))
    run_step(scheduler, runner)
    scheduler.abort_request("a")
    again = make_request("a", 8, max_tokens=3, ignore_eos=True)
    scheduler.add_request(again)
    drain(scheduler, runner)
    assert len(again.output_token_ids) == 3
    _assert_idle_and_clean(scheduler)


# ---- refusals --------------------------------------------------------------------


def test_invalid_requests_refused_and_others_keep_running() -> None:
    scheduler = make_scheduler(max_model_len=64, block_size=4, num_blocks=8)
    runner = SimulatedRunner(scheduler)
    good = make_request("good", 10, max_tokens=5, ignore_eos=True)
    scheduler.add_request(good)
    run_step(scheduler, runner)

    with pytest.raises(ValueError, match=r"request_id 'good'"):
        scheduler.add_request(make_request("good", 5))
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        scheduler.add_request(Request("empty", []))
    with pytest.raises(ValueError, match="max_model_len=64"):
        scheduler.add_request(make_request("long", 64))
    with pytest.raises(ValueError, match="max_model_len=64"):
        scheduler.add_request(make_request("longer", 200))
    # 8 blocks of 4 slots hold 32 tokens; 20 + 20 can never fit.
    with pytest.raises(ValueError, match="num_blocks=8"):
        scheduler.add_request(make_request("huge", 20, max_tokens=20))

    assert set(scheduler.requests) == {"good"}
    assert scheduler.requests["good"] is good
    drain(scheduler, runner)
    assert len(good.output_token_ids) == 5
    _assert_idle_and_clean(scheduler)


def test_prompt_one_below_max_model_len_is_accepted() -> None:
    scheduler = make_scheduler(max_model_len=64)
    scheduler.add_request(make_request("ok", 63))
    assert "ok" in scheduler.requests


def test_request_that_fits_the_pool_exactly_is_accepted_and_finishes() -> None:
    # 8 blocks x 4 = 32 slots: 16 prompt + 15 outputs use 31 known tokens.
    scheduler = make_scheduler(block_size=4, num_blocks=8)
    request = make_request("fit", 16, max_tokens=15, ignore_eos=True)
    scheduler.add_request(request)
    drain(scheduler, SimulatedRunner(scheduler))
    assert len(request.output_token_ids) == 15
    _assert_idle_and_clean(scheduler)


@pytest.mark.parametrize("method", ["pard", "dflash", "eagle", "draft_model"])
def test_accepted_request_never_livelocks_on_a_tiny_pool(method: str) -> None:
    """Whatever add_request accepts on a pool that just fits, must finish alone; what
    it refuses is refused for the KV it may need (and something must be admitted, or
    the test would pass without running anything)."""
    scheduler = make_scheduler(method, k=3, block_size=4, num_blocks=10)
    admitted = []
    for prompt, max_tokens in ((8, 40), (20, 10), (4, 20)):
        request = make_request(f"r{prompt}", prompt, max_tokens=max_tokens, ignore_eos=True)
        if prompt + max_tokens > 10 * 4:  # more slots than the whole pool
            with pytest.raises(ValueError, match=r"may need 12 KV blocks"):
                scheduler.add_request(request)
            continue
        scheduler.add_request(request)
        admitted.append(request.request_id)
        drain(scheduler, SimulatedRunner(scheduler, acceptance=1.0), max_steps=500)
        assert len(request.output_token_ids) == max_tokens
        _assert_idle_and_clean(scheduler)
    assert admitted == ["r20", "r4"]


# ---- chunked prefill -------------------------------------------------------------


@pytest.mark.parametrize(("prompt_len", "budget"), [(100, 32), (64, 32), (33, 32), (7, 32)])
def test_chunked_prefill_takes_ceil_chunks_and_only_last_samples(prompt_len: int,
                                                                 budget: int) -> None:
    scheduler = make_scheduler(budget=budget)
    runner = SimulatedRunner(scheduler)
    request = make_request("a", prompt_len, max_tokens=2, ignore_eos=True)
    scheduler.add_request(request)
    chunks, sampled = [], []
    while not request.output_token_ids:
        out, result = run_step(scheduler, runner)
        chunks.append(out.num_scheduled_tokens["a"])
        sampled.append(result.sampled_token_ids[result.req_ids.index("a")])
    assert len(chunks) == math.ceil(prompt_len / budget)
    assert sum(chunks) == prompt_len
    assert all(chunk <= budget for chunk in chunks)
    assert all(s == [] for s in sampled[:-1])
    assert len(sampled[-1]) == 1
    drain(scheduler, runner)
    _assert_idle_and_clean(scheduler)


def test_no_chunked_prefill_schedules_whole_prompts_only() -> None:
    scheduler = make_scheduler(budget=256, max_model_len=256, enable_chunked_prefill=False)
    runner = SimulatedRunner(scheduler)
    a = make_request("a", 150, max_tokens=3, ignore_eos=True)
    b = make_request("b", 150, max_tokens=3, ignore_eos=True, first_token=300)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 150}  # b does not fit the rest; no chunk
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 150}
    drain(scheduler, runner)
    _assert_idle_and_clean(scheduler)


def test_chunked_prefill_fills_the_rest_of_the_budget() -> None:
    scheduler = make_scheduler(budget=256, max_model_len=256)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 150, max_tokens=3, ignore_eos=True))
    scheduler.add_request(make_request("b", 150, max_tokens=3, ignore_eos=True,
                                       first_token=300))
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 150, "b": 106}


@pytest.mark.parametrize(("prompt_len", "threshold"), [(35, 10), (40, 10), (9, 10)])
def test_long_prefill_threshold_caps_chunk_size(prompt_len: int, threshold: int) -> None:
    scheduler = make_scheduler(budget=64, long_prefill_token_threshold=threshold)
    runner = SimulatedRunner(scheduler)
    request = make_request("a", prompt_len, max_tokens=2, ignore_eos=True)
    scheduler.add_request(request)
    chunks = []
    while not request.output_token_ids:
        out, _ = run_step(scheduler, runner)
        chunks.append(out.num_scheduled_tokens["a"])
    assert max(chunks) <= threshold
    assert sum(chunks) == prompt_len
    assert len(chunks) == math.ceil(prompt_len / threshold)


def test_long_prefill_threshold_without_chunking_still_makes_progress() -> None:
    scheduler = make_scheduler(budget=256, max_model_len=256, enable_chunked_prefill=False,
                               long_prefill_token_threshold=8)
    request = make_request("a", 20, max_tokens=2, ignore_eos=True)
    scheduler.add_request(request)  # accepted, so it must run (or be refused up front)
    drain(scheduler, SimulatedRunner(scheduler), max_steps=50)
    assert len(request.output_token_ids) == 2


# ---- admission order and limits ---------------------------------------------------


def test_max_num_seqs_caps_running() -> None:
    scheduler = make_scheduler(max_num_seqs=3)
    runner = SimulatedRunner(scheduler)
    for i in range(8):
        scheduler.add_request(make_request(f"r{i}", 4, max_tokens=3, ignore_eos=True,
                                           first_token=10 + 20 * i))
    outputs = _drain_recording(scheduler, runner)
    assert len(outputs[0].num_scheduled_tokens) == 3
    assert all(out.num_reqs <= 3 for out in outputs)
    _assert_idle_and_clean(scheduler)


def test_fcfs_admits_in_arrival_order() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    runner = SimulatedRunner(scheduler)
    names = ["d", "a", "c", "b", "e"]
    for name in names:
        scheduler.add_request(make_request(name, 4, max_tokens=2, ignore_eos=True))
    admitted = []
    for out in _drain_recording(scheduler, runner):
        admitted += [new.req_id for new in out.scheduled_new_reqs]
    assert admitted == names


def test_fcfs_ignores_priority() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner = SimulatedRunner(scheduler)
    for i, prio in enumerate([5, 0, 3]):
        scheduler.add_request(_req(f"p{prio}", 4, max_tokens=1, priority=prio,
                                   arrival=float(i)))
    admitted = []
    for out in _drain_recording(scheduler, runner):
        admitted += [new.req_id for new in out.scheduled_new_reqs]
    assert admitted == ["p5", "p0", "p3"]


def test_fcfs_no_skipping_ahead_of_a_blocked_head() -> None:
    # The head needs more KV than is free; a small request behind it must wait too.
    scheduler = make_scheduler(block_size=4, num_blocks=10, max_num_seqs=8)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("big0", 20, max_tokens=15, ignore_eos=True))
    run_step(scheduler, runner)
    scheduler.add_request(make_request("big1", 20, max_tokens=15, ignore_eos=True,
                                       first_token=300))
    scheduler.add_request(make_request("small", 2, max_tokens=2, ignore_eos=True,
                                       first_token=700))
    out, _ = run_step(scheduler, runner)
    assert "big1" not in out.num_scheduled_tokens
    assert "small" not in out.num_scheduled_tokens


def test_priority_admits_lower_value_first_ties_by_arrival() -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    runner = SimulatedRunner(scheduler)
    spec = [("late-1", 1, 3.0), ("p9", 9, 0.0), ("early-1", 1, 1.0), ("p0", 0, 2.0),
            ("p5", 5, 4.0)]
    for rid, prio, arrival in spec:
        scheduler.add_request(_req(rid, 4, max_tokens=1, priority=prio, arrival=arrival))
    admitted = []
    for out in _drain_recording(scheduler, runner):
        admitted += [new.req_id for new in out.scheduled_new_reqs]
    assert admitted == ["p0", "early-1", "late-1", "p5", "p9"]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_preemption_victim_under_kv_pressure(policy: str) -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=8, policy=policy)
    runner = SimulatedRunner(scheduler)
    # Admitted in two steps so the lowest priority is not the newest running request.
    scheduler.add_request(_req("low", 3, max_tokens=12, priority=5, arrival=0.0))
    run_step(scheduler, runner)
    scheduler.add_request(_req("high", 3, max_tokens=12, priority=0, arrival=1.0,
                               first_token=100))
    scheduler.add_request(_req("mid", 3, max_tokens=12, priority=2, arrival=2.0,
                               first_token=200))
    first_victim = None
    for out in _drain_recording(scheduler, runner):
        if out.preempted_req_ids and first_victim is None:
            assert len(out.preempted_req_ids) == 1
            first_victim = next(iter(out.preempted_req_ids))
    assert scheduler.stats.num_preemptions > 0
    # priority: the highest value goes first; fcfs: the newest running request.
    assert first_victim == ("low" if policy == "priority" else "mid")
    _assert_idle_and_clean(scheduler)


# ---- preemption ---------------------------------------------------------------------


@pytest.mark.parametrize("method", [None, "ngram", "eagle", "pard", "dflash"])
def test_preempted_requests_resume_with_outputs_intact(method: str | None) -> None:
    scheduler = make_scheduler(method, k=2, block_size=4, num_blocks=14)
    runner = SimulatedRunner(scheduler, acceptance=0.6, seed=3)
    requests = [make_request(f"r{i}", 10, max_tokens=20, ignore_eos=True,
                             first_token=10 + 60 * i) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    snapshots: dict[str, list[list[int]]] = {}
    steps = 0
    while scheduler.has_unfinished_requests():
        out, _ = run_step(scheduler, runner)
        scheduler.kv.pool.check_integrity()
        for rid in out.preempted_req_ids:
            request = next(r for r in requests if r.request_id == rid)
            assert request.num_computed_tokens == 0
            assert rid not in scheduler.kv.req_blocks
            snapshots.setdefault(rid, []).append(list(request.output_token_ids))
        steps += 1
        assert steps < 1000
    assert scheduler.stats.num_preemptions > 0
    assert snapshots
    for request in requests:
        assert len(request.output_token_ids) == 20
        assert request.finish_reason == "length"
        assert request.all_token_ids == request.prompt_token_ids + request.output_token_ids
        for snap in snapshots.get(request.request_id, []):
            assert request.output_token_ids[:len(snap)] == snap
    assert sum(r.num_preemptions for r in requests) == scheduler.stats.num_preemptions
    _assert_idle_and_clean(scheduler)


def test_resumed_request_recomputes_prompt_and_outputs() -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=8, enable_prefix_caching=False)
    runner = SimulatedRunner(scheduler)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=12, ignore_eos=True,
                                           first_token=10 + 50 * i))
    outputs = _drain_recording(scheduler, runner)
    victims = set().union(*(out.preempted_req_ids for out in outputs))
    assert victims
    resumed = [new for out in outputs for new in out.scheduled_new_reqs
               if new.req_id in victims and new.output_token_ids]
    assert resumed
    for new in resumed:
        assert new.num_computed_tokens == 0  # no prefix caching: all recomputed
        out = next(o for o in outputs if new in o.scheduled_new_reqs)
        known = len(new.prompt_token_ids) + len(new.output_token_ids)
        assert out.num_scheduled_tokens[new.req_id] == known


# ---- speculative decoding bookkeeping ---------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "eagle", "pard", "dflash", "draft_model"])
def test_rejected_drafts_roll_back_num_computed_tokens(method: str) -> None:
    scheduler = make_scheduler(method, k=3)
    runner = SimulatedRunner(scheduler, acceptance=0.0)
    request = make_request("a", 9, max_tokens=30, ignore_eos=True)
    scheduler.add_request(request)
    run_step(scheduler, runner)  # prefill: proposes drafts
    assert len(request.spec_token_ids) == 3
    for _ in range(4):
        tokens_before = request.num_tokens
        out = scheduler.schedule()
        verified = len(out.scheduled_spec_decode_tokens["a"])
        assert verified == 3
        assert request.num_computed_tokens == tokens_before + verified
        scheduler.update_from_output(out, runner.execute(out))
        assert request.num_tokens == tokens_before + 1  # all rejected: one token
        assert request.num_computed_tokens == request.num_tokens - 1
    assert scheduler.stats.num_verified_drafts == 12
    assert scheduler.stats.num_accepted_drafts == 0


def test_accepted_drafts_keep_their_kv() -> None:
    scheduler = make_scheduler("ngram", k=3)
    runner = SimulatedRunner(scheduler, acceptance=1.0)
    request = make_request("a", 9, max_tokens=30, ignore_eos=True)
    scheduler.add_request(request)
    run_step(scheduler, runner)
    tokens_before = request.num_tokens
    run_step(scheduler, runner)
    assert request.num_tokens == tokens_before + 4
    assert request.num_computed_tokens == request.num_tokens - 1
    assert scheduler.stats.num_accepted_drafts == 3


def test_runner_proposing_too_many_drafts_raises() -> None:
    scheduler = make_scheduler("ngram", k=2)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 9, max_tokens=30, ignore_eos=True))
    out = scheduler.schedule()
    assert out.num_draft_tokens["a"] == 2
    result = runner.execute(out)
    bad = ModelRunnerOutput(result.req_ids, result.sampled_token_ids, {"a": [5, 6, 7]})
    with pytest.raises(ValueError, match="num_draft_tokens=2"):
        scheduler.update_from_output(out, bad)


def test_runner_proposing_drafts_when_none_charged_raises() -> None:
    scheduler = make_scheduler(None)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 9, max_tokens=30, ignore_eos=True))
    out = scheduler.schedule()
    result = runner.execute(out)
    bad = ModelRunnerOutput(result.req_ids, result.sampled_token_ids, {"a": [5]})
    with pytest.raises(ValueError, match="num_draft_tokens=0"):
        scheduler.update_from_output(out, bad)


def test_runner_sampling_more_than_verified_plus_one_raises() -> None:
    scheduler = make_scheduler(None)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 9, max_tokens=30, ignore_eos=True))
    out = scheduler.schedule()
    result = runner.execute(out)
    bad = ModelRunnerOutput(result.req_ids, [[1, 2]])
    with pytest.raises(ValueError, match="at most 1"):
        scheduler.update_from_output(out, bad)


# ---- prefix caching ------------------------------------------------------------------


def test_identical_prompt_hits_prefix_cache_at_admission() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = SimulatedRunner(scheduler)
    first = make_request("first", 18, max_tokens=3, ignore_eos=True)
    scheduler.add_request(first)
    drain(scheduler, runner)
    assert scheduler.stats.num_prefix_hit_tokens == 0
    second = make_request("second", 18, max_tokens=3, ignore_eos=True)
    scheduler.add_request(second)
    out, _ = run_step(scheduler, runner)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 16  # 4 full blocks of the 18-token prompt
    assert scheduler.stats.num_prefix_hit_tokens == 16
    assert out.num_scheduled_tokens["second"] == 2
    drain(scheduler, runner)
    assert len(second.output_token_ids) == 3
    _assert_idle_and_clean(scheduler)


def test_prefix_shared_while_both_running() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 12, max_tokens=10, ignore_eos=True))
    run_step(scheduler, runner)
    scheduler.add_request(make_request("b", 12, max_tokens=10, ignore_eos=True))
    run_step(scheduler, runner)
    # Exactly 3 full blocks: the hit is capped one token short, so 2 are shared.
    assert scheduler.stats.num_prefix_hit_tokens == 8
    shared = scheduler.kv.req_blocks["a"][:2]
    assert scheduler.kv.req_blocks["b"][:2] == shared
    assert all(block.ref_cnt == 2 for block in shared)
    drain(scheduler, runner)
    _assert_idle_and_clean(scheduler)


def test_no_prefix_hits_when_caching_disabled() -> None:
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=False)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("a", 18, max_tokens=3, ignore_eos=True))
    drain(scheduler, runner)
    scheduler.add_request(make_request("b", 18, max_tokens=3, ignore_eos=True))
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens["b"] == 18
    assert scheduler.stats.num_prefix_hit_tokens == 0


def test_prefix_cached_even_when_request_finishes_on_first_token() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = SimulatedRunner(scheduler)
    scheduler.add_request(make_request("first", 18, max_tokens=1, ignore_eos=True))
    drain(scheduler, runner)
    scheduler.add_request(make_request("second", 18, max_tokens=1, ignore_eos=True))
    run_step(scheduler, runner)
    assert scheduler.stats.num_prefix_hit_tokens == 16


def test_fcfs_preempted_request_resumes_before_newer_arrivals() -> None:
    # Two requests of 15 tokens need 8 blocks of 4; the pool has 7.
    scheduler = make_scheduler(block_size=4, num_blocks=7, max_num_seqs=2)
    runner = SimulatedRunner(scheduler)
    for i, rid in enumerate(["a", "b", "c"]):
        scheduler.add_request(make_request(rid, 3, max_tokens=12, ignore_eos=True,
                                           first_token=10 + 50 * i))
    outputs = _drain_recording(scheduler, runner)
    at = next(i for i, out in enumerate(outputs) if out.preempted_req_ids)
    assert outputs[at].preempted_req_ids == {"b"}  # the newest running request
    admitted_after = [new.req_id for out in outputs[at + 1:] for new in out.scheduled_new_reqs]
    assert admitted_after[0] == "b"
    assert "c" in admitted_after
    _assert_idle_and_clean(scheduler)


@pytest.mark.parametrize("method", [None, "ngram", "suffix", "eagle", "dflash"])
def test_admission_charges_no_more_kv_than_the_request_can_hold(method: str | None) -> None:
    """B=32, 2 blocks of 4: a 4-token prompt with max_tokens 3 holds at most 6 slots
    (its 7th token is sampled, never computed), under any method: drafts and the
    drafter's lookahead stay inside that by the k rule. It used to be refused as
    needing 3 blocks under ngram K=4."""
    sched = make_scheduler(method, k=4, budget=32, max_num_seqs=4, max_model_len=64,
                           block_size=4, num_blocks=2, enable_prefix_caching=False)
    runner = SimulatedRunner(sched, acceptance=1.0, seed=0)
    sched.add_request(make_request("r", 4, max_tokens=3, ignore_eos=True))
    drain(sched, runner)
    with pytest.raises(ValueError, match="may need 3 KV blocks"):
        sched.add_request(make_request("s", 4, max_tokens=6))


def test_priority_preemption_offers_the_refund_to_requests_already_planned() -> None:
    """pard K=2, B=7, 7 blocks of 2: at step 3 r1 (priority 1) is planned with the rows
    r0 (priority 2) was charged first, then r0 is preempted for KV and refunded: r1
    must get the refund (n=3, both drafts verified), not keep the n=2 it was planned
    with (what the scheduler did before)."""
    sched = make_scheduler("pard", k=2, budget=7, max_num_seqs=4, max_model_len=16,
                           block_size=2, num_blocks=7, policy="priority",
                           enable_prefix_caching=False)
    runner = SimulatedRunner(sched, acceptance=0.0, seed=0)
    sched.add_request(Request("r0", list(range(10, 16)), SamplingParams(max_tokens=4),
                              priority=2))
    run_step(sched, runner)
    sched.add_request(Request("r1", [20, 21], SamplingParams(max_tokens=8), priority=1))
    run_step(sched, runner)
    out, _ = run_step(sched, runner)
    assert out.preempted_req_ids == {"r0"}
    assert out.num_scheduled_tokens == {"r1": 3}
    assert len(out.scheduled_spec_decode_tokens["r1"]) == 2
    assert all(rows <= 7 for rows in out.pass_rows.values())
    sched.kv.pool.check_integrity()
    drain(sched, runner)


def test_update_from_output_reports_what_each_request_gained() -> None:
    """The engine learns new tokens only from these outputs: tokens up to the first
    stop condition, with their logprobs trimmed alongside, and the finish."""
    from scheduler import ModelRunnerOutput

    scheduler = make_scheduler("ngram", k=2)
    scheduler.add_request(make_request("a", 6, max_tokens=10))
    out = scheduler.schedule()
    lp = ([1], [-0.1])
    (first,) = scheduler.update_from_output(
        out, ModelRunnerOutput(["a"], [[5]], {"a": [6, 2]}, logprobs={"a": [lp]}))
    assert (first.new_token_ids, first.finished, first.logprobs) == ([5], False, [lp])
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [6, 2]}
    (last,) = scheduler.update_from_output(
        out, ModelRunnerOutput(["a"], [[6, 2, 9]], logprobs={"a": [lp, lp, lp]}))
    assert last.new_token_ids == [6, 2]  # eos 2 stops it; 9 is dropped
    assert last.logprobs == [lp, lp]
    assert (last.finished, last.finish_reason) == (True, "stop")
    assert scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput([], [])) == []
