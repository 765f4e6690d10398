"""EngineMetrics: vLLM's metric names under `specbudget:`, counters without double
counting, and the throttle's per-pass rows; a fake core, then the real model."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from engine.core import EngineCore
from engine.metrics import EngineMetrics
from engine.output import LatencySample, OutputProcessor, RequestDelta
from engine.tokenizer import Tokenizer
from runner.model_loader import load_model
from runner.model_prep import resolve_model
from runner.models.llama import LlamaForCausalLM
from scheduler import Request, SamplingParams
from scheduler.stats import SchedulerStats

pytestmark = pytest.mark.model  # loads the real default model

MODEL = "test-model"


@dataclass
class FakeConfig:
    max_num_batched_tokens: int = 64


@dataclass
class FakeScheduler:
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    running: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    usage: float = 0.0

    def kv_cache_usage(self) -> float:
        return self.usage


@dataclass
class FakeRunner:
    last_pass_rows: dict[str, int] = field(default_factory=dict)


@dataclass
class FakeCore:
    config: FakeConfig = field(default_factory=FakeConfig)
    scheduler: FakeScheduler = field(default_factory=FakeScheduler)
    runner: FakeRunner = field(default_factory=FakeRunner)


def delta(rid: str, new: list[int], total: int, finished: bool = False,
          reason: str | None = None, prompt: int = 5) -> RequestDelta:
    return RequestDelta(rid, new, "x" * len(new), finished, reason, prompt, total)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(f"specbudget:{name}", {"model_name": MODEL, **labels})


def test_gauges_follow_the_last_step() -> None:
    registry, core = CollectorRegistry(), FakeCore()
    metrics = EngineMetrics(registry, MODEL)
    core.scheduler.running, core.scheduler.waiting, core.scheduler.usage = ["a", "b"], ["c"], 0.25
    metrics.on_step(core, [], {})
    assert value(registry, "num_requests_running") == 2
    assert value(registry, "num_requests_waiting") == 1
    assert value(registry, "kv_cache_usage_perc") == 0.25
    core.scheduler.running, core.scheduler.waiting, core.scheduler.usage = [], [], 0.0
    metrics.on_step(core, [], {})
    assert value(registry, "num_requests_running") == 0
    assert value(registry, "kv_cache_usage_perc") == 0.0


def test_token_and_request_counters_from_deltas() -> None:
    registry, core = CollectorRegistry(), FakeCore()
    metrics = EngineMetrics(registry, MODEL)
    # Step 1: "a" gets its first token, "b" its first three (prompt counted once each).
    metrics.on_step(core, [delta("a", [1], 1, prompt=7), delta("b", [1, 2, 3], 3, prompt=4)],
                    {"a": LatencySample(ttft=0.5), "b": LatencySample(ttft=0.25)})
    # Step 2: "a" two more and finishes on length; "b" stops.
    metrics.on_step(core, [delta("a", [4, 5], 3, True, "length", prompt=7),
                           delta("b", [6], 4, True, "stop", prompt=4)],
                    {"a": LatencySample(itl=[0.05, 0.05], e2e=1.0),
                     "b": LatencySample(itl=[0.1], e2e=2.0)})
    assert value(registry, "prompt_tokens_total") == 11
    assert value(registry, "generation_tokens_total") == 7
    assert value(registry, "request_success_total", finished_reason="length") == 1
    assert value(registry, "request_success_total", finished_reason="stop") == 1
    assert value(registry, "time_to_first_token_seconds_count") == 2
    assert value(registry, "time_to_first_token_seconds_sum") == 0.75
    assert value(registry, "inter_token_latency_seconds_count") == 3
    assert value(registry, "e2e_request_latency_seconds_count") == 2
    assert value(registry, "e2e_request_latency_seconds_bucket", le="1.0") == 1
    assert value(registry, "request_generation_tokens_sum") == 7


def test_cumulative_stats_counted_once_across_steps() -> None:
    registry, core = CollectorRegistry(), FakeCore()
    metrics = EngineMetrics(registry, MODEL)
    stats = core.scheduler.stats
    stats.record_verification(3, 2)  # one draft: positions 0, 1 accepted
    stats.num_preemptions = 1
    metrics.on_step(core, [], {})
    metrics.on_step(core, [], {})  # nothing new: nothing added
    assert value(registry, "spec_decode_num_drafts_total") == 1
    assert value(registry, "spec_decode_num_draft_tokens_total") == 3
    assert value(registry, "spec_decode_num_accepted_tokens_total") == 2
    assert value(registry, "num_preemptions_total") == 1
    stats.record_verification(4, 4)  # a longer draft: a new position appears
    stats.record_verification(2, 0)
    stats.num_preemptions = 3
    metrics.on_step(core, [], {})
    assert value(registry, "spec_decode_num_drafts_total") == 3
    assert value(registry, "spec_decode_num_draft_tokens_total") == 9
    assert value(registry, "spec_decode_num_accepted_tokens_total") == 6
    assert value(registry, "num_preemptions_total") == 3
    per_pos = [value(registry, "spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(i)) for i in range(5)]
    assert per_pos == [2, 2, 1, 1, None]
    assert per_pos[:4] == stats.spec.num_accepted_tokens_per_pos


def test_a_restarted_engine_counts_on_from_its_own_zero() -> None:
    """A new engine process's cumulative counts start again at zero: the exported
    totals keep growing by what it adds (a negative increment raised in the thread
    that serves every stream)."""
    registry, core = CollectorRegistry(), FakeCore()
    metrics = EngineMetrics(registry, MODEL)
    core.scheduler.stats.num_steps = 50
    core.scheduler.stats.record_verification(3, 2)
    core.scheduler.stats.num_preemptions = 4
    metrics.on_step(core, [], {})
    restarted = FakeCore()
    restarted.scheduler.stats.num_steps = 2
    restarted.scheduler.stats.record_verification(2, 1)
    metrics.on_step(restarted, [], {})
    assert value(registry, "spec_decode_num_drafts_total") == 2
    assert value(registry, "spec_decode_num_draft_tokens_total") == 5
    assert value(registry, "spec_decode_num_accepted_tokens_total") == 3
    assert value(registry, "num_preemptions_total") == 4
    restarted.scheduler.stats.record_verification(1, 1)
    restarted.scheduler.stats.num_steps = 3
    metrics.on_step(restarted, [], {})
    assert value(registry, "spec_decode_num_draft_tokens_total") == 6


def test_draft_policy_choices_and_step_time_predictions() -> None:
    """The chosen-k and shadow counters add each step's new counts once; the step-time
    gauges show the last timed step, the mean error and the stalls; the request weight,
    the last learnt."""
    import numpy as np

    registry, core = CollectorRegistry(), FakeCore()
    metrics = EngineMetrics(registry, MODEL)
    goodput = core.scheduler.stats.goodput
    goodput.record_drafts(np.array([0, 2, 2]))
    goodput.record_time(0.010, 0.012)
    goodput.record_shadows([1, 0, 0])
    metrics.on_step(core, [], {})
    goodput.record_drafts(np.array([0, 0]))
    goodput.record_time(0.020, 0.016)
    goodput.record_shadows([1, 1])
    goodput.request_weight = 12.5
    goodput.stall_steps = 2
    metrics.on_step(core, [], {})
    chosen = [value(registry, "spec_decode_chosen_k_total", k=str(k)) for k in range(3)]
    assert chosen == [3, 0, 2]
    assert value(registry, "spec_decode_share_steps_k0") == 0.5
    assert value(registry, "step_seconds_predicted") == 0.020
    assert value(registry, "step_seconds_measured") == 0.016
    assert value(registry, "step_seconds_mean_abs_error") == pytest.approx(0.003)
    assert value(registry, "spec_decode_request_weight") == 12.5
    assert value(registry, "step_seconds_stall_steps") == 2
    assert value(registry, "spec_decode_shadow_checks_total") == 5
    assert value(registry, "spec_decode_shadow_hits_total") == 3


def test_budget_pass_rows_and_utilization() -> None:
    registry, core = CollectorRegistry(), FakeCore()
    metrics = EngineMetrics(registry, MODEL)
    core.runner.last_pass_rows = {"target": 48, "step_1": 8, "step_2": 4}
    metrics.on_step(core, [], {})
    core.runner.last_pass_rows = {"target": 16, "step_1": 2}  # no step_2 this time
    metrics.on_step(core, [], {})
    assert value(registry, "budget_pass_rows_count", **{"pass": "target"}) == 2
    assert value(registry, "budget_pass_rows_sum", **{"pass": "target"}) == 64
    assert value(registry, "budget_pass_rows_count", **{"pass": "step_2"}) == 1
    assert value(registry, "budget_pass_utilization", **{"pass": "target"}) == 0.25
    assert value(registry, "budget_pass_utilization", **{"pass": "step_2"}) == 0.0


def test_every_metric_carries_model_name_and_unregister_frees_names() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, MODEL)
    metrics.on_step(FakeCore(runner=FakeRunner({"target": 1})),
                    [delta("a", [1], 1, True, "stop")], {"a": LatencySample(ttft=0.1)})
    text = generate_latest(registry).decode()
    samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert samples and all(f'model_name="{MODEL}"' in ln for ln in samples)
    expected = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                "request_success_total", "time_to_first_token_seconds_bucket",
                "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                "spec_decode_num_accepted_tokens_total", "spec_decode_shadow_checks_total",
                "budget_pass_rows_bucket", "budget_pass_utilization"]
    for name in expected:
        assert f"specbudget:{name}" in text, name
    metrics.unregister()
    EngineMetrics(registry, MODEL)  # the same names register again


# ---- the real engine -----------------------------------------------------------------

@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return load_model(resolve_model(None), torch.float32, torch.device("cpu"))


def test_real_core_dflash_counts_match_scheduler_stats(model: LlamaForCausalLM) -> None:
    """dflash K=2 on the default model: context and query passes show, counters equal
    the scheduler's own cumulative stats after many steps."""
    from engine.config import EngineConfig
    from spec_decode import SpeculativeConfig

    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256,
                          num_kv_blocks=64,
                          speculative_config=SpeculativeConfig("dflash", 2, model="random"))
    core = EngineCore(config, model=model)
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, MODEL)
    prompts = [[1, 504, 3437, 8260, 28, 29] * 3, [1, 504, 3437] * 2]
    processor = OutputProcessor(Tokenizer.from_dir(core.runner.model_path))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(Request(str(i), prompt, params, eos_token_id=2))
        processor.add(str(i), len(prompt), params)
    generated, steps, max_query = 0, 0, 0
    while core.has_unfinished_requests():
        deltas, _, latency = processor.process(core.step())
        generated += sum(len(d.new_token_ids) for d in deltas)
        max_query = max(max_query, core.runner.last_pass_rows.get("query", 0))
        metrics.on_step(core, deltas, latency)
        steps += 1
    stats = core.scheduler.stats
    assert stats.spec.num_drafts > 0 and max_query > 0
    assert value(registry, "generation_tokens_total") == generated == 10
    assert value(registry, "prompt_tokens_total") == sum(map(len, prompts))
    assert value(registry, "request_success_total", finished_reason="length") == 2
    assert value(registry, "spec_decode_num_drafts_total") == stats.spec.num_drafts
    assert value(registry, "spec_decode_num_draft_tokens_total") == stats.spec.num_draft_tokens
    assert (value(registry, "spec_decode_num_accepted_tokens_total")
            == stats.spec.num_accepted_tokens)
    for pos, accepted in enumerate(stats.spec.num_accepted_tokens_per_pos):
        assert value(registry, "spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(pos)) == accepted
    for name in ("target", "context", "query"):
        assert value(registry, "budget_pass_rows_count", **{"pass": name}) == steps
    assert value(registry, "budget_pass_rows_bucket", **{"pass": "query"}, le="64.0") == steps
    assert value(registry, "budget_pass_rows_sum", **{"pass": "target"}) == (
        stats.num_scheduled_tokens)
    assert value(registry, "time_to_first_token_seconds_count") == 2
    assert value(registry, "e2e_request_latency_seconds_count") == 2
    assert value(registry, "inter_token_latency_seconds_count") > 0
    # Two requests of 5 tokens: TPOT is one mean per request, not one per token.
    assert value(registry, "request_time_per_output_token_seconds_count") == 2
    assert (value(registry, "request_time_per_output_token_seconds_sum")
            <= value(registry, "e2e_request_latency_seconds_sum") / 4)
    assert value(registry, "num_requests_running") == 0
    assert value(registry, "kv_cache_usage_perc") == 0.0
