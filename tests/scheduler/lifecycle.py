"""What the scheduler lifecycle tests share: an ignore-eos request, a recording drain,
and the check that a drained scheduler holds nothing."""

from __future__ import annotations

from runner.simulated import SimulatedRunner
from scheduler import Request, SamplingParams, Scheduler, SchedulerOutput
from tests.helpers import run_step

EOS = 2  # make_request's eos_token_id


def assert_idle_and_clean(scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished_requests()
    assert scheduler.running == []
    assert len(scheduler.waiting) == 0
    assert scheduler.kv_cache_usage() == 0.0
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks
    assert scheduler.kv.req_blocks == {}
    scheduler.kv.pool.check_integrity()


def ignore_eos_request(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0,
                       arrival: float = 0.0, first_token: int = 10) -> Request:
    prompt = [first_token + i for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=EOS, priority=priority, arrival_time=arrival)


def drain_recording(scheduler: Scheduler, runner: SimulatedRunner,
                    max_steps: int = 2000) -> list[SchedulerOutput]:
    """Drain, returning every step's SchedulerOutput."""
    outputs = []
    while scheduler.has_unfinished_requests():
        out, _ = run_step(scheduler, runner)
        scheduler.kv.pool.check_integrity()
        outputs.append(out)
        assert len(outputs) < max_steps, "no progress"
    return outputs
