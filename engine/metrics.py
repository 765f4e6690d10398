"""Prometheus metrics for the server, named as operators know them from vLLM.

vLLM's `vllm:<name>` is ours as `specbudget:<name>`, with the same label
(`model_name`), units and histogram buckets, so dashboards carry over. On top of
vLLM's set, the throttle's own view: the rows each forward pass (target, and each
drafter pass of the method) used in a step, and that step's share of B
(`max_num_batched_tokens`).

`EngineMetrics.on_step` is an `AsyncEngine.on_step` hook: it runs on the engine thread
after every step. Request counters come from that step's deltas; preemption and
spec-decode counters from the scheduler's cumulative stats, of which the hook keeps
the last values seen and adds only the difference, so nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.output import LatencySample, RequestDelta
from scheduler.stats import GoodputStats, SchedulerStats

PREFIX = "specbudget:"

# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's build_1_2_5_buckets up to 8192 tokens, for per-request token counts.
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
# Rows of one forward pass: powers of two up to 64k, whatever B is.
ROW_BUCKETS = tuple(float(2 ** i) for i in range(17))


class _Runner(Protocol):
    @property
    def last_pass_rows(self) -> dict[str, int]: ...


class _Scheduler(Protocol):
    @property
    def stats(self) -> SchedulerStats: ...
    @property
    def running(self) -> Sized: ...
    @property
    def waiting(self) -> Sized: ...
    def kv_cache_usage(self) -> float: ...


class _Config(Protocol):
    @property
    def max_num_batched_tokens(self) -> int: ...


class CoreView(Protocol):
    """What the hook reads of EngineCore (tests pass a small fake with these)."""

    @property
    def config(self) -> _Config: ...
    @property
    def scheduler(self) -> _Scheduler: ...
    @property
    def runner(self) -> _Runner: ...


@dataclass
class _SeenStats:
    """The cumulative scheduler counts already exported."""

    num_preemptions: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    chosen_k: list[int] = field(default_factory=list)
    num_steps: int = 0
    shadow_checks: int = 0
    shadow_hits: int = 0


class EngineMetrics:
    """Every `specbudget:*` metric of one served model, in `registry`.

    Register `on_step` on `AsyncEngine.on_step`; call `unregister()` before building
    another instance on the same registry (in-process servers started in turn).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name
        self._collectors: list[Any] = []
        self._seen = _SeenStats()
        self._pass_names: set[str] = set()
        self._make_gauges()
        self._make_counters()
        self._make_histograms()

    # ---- definitions ------------------------------------------------------------

    def _add(self, kind: type, name: str, doc: str, labels: tuple[str, ...] = (),
             **kwargs: Any) -> Any:
        metric = kind(PREFIX + name, doc, ("model_name", *labels), registry=self.registry,
                      **kwargs)
        self._collectors.append(metric)
        return metric

    def _make_gauges(self) -> None:
        m = self.model_name
        self.num_requests_running = self._add(
            Gauge, "num_requests_running", "Requests in the running set.").labels(m)
        self.num_requests_waiting = self._add(
            Gauge, "num_requests_waiting", "Requests waiting to be scheduled.").labels(m)
        self.kv_cache_usage_perc = self._add(
            Gauge, "kv_cache_usage_perc", "KV-cache usage, 1 = full.").labels(m)
        self.budget_pass_utilization = self._add(
            Gauge, "budget_pass_utilization",
            "Rows of each forward pass in the last step / max_num_batched_tokens.",
            ("pass",))

    def _make_counters(self) -> None:
        m = self.model_name
        self.num_preemptions = self._add(
            Counter, "num_preemptions_total", "Cumulative preemptions.").labels(m)
        self.prompt_tokens = self._add(
            Counter, "prompt_tokens_total", "Prefill tokens processed.").labels(m)
        self.generation_tokens = self._add(
            Counter, "generation_tokens_total", "Generation tokens produced.").labels(m)
        self.request_success = self._add(
            Counter, "request_success_total", "Finished requests, by finish reason.",
            ("finished_reason",))
        self.spec_num_drafts = self._add(
            Counter, "spec_decode_num_drafts_total",
            "Verifications of one request's drafts in one step.").labels(m)
        self.spec_num_draft_tokens = self._add(
            Counter, "spec_decode_num_draft_tokens_total", "Draft tokens verified.").labels(m)
        self.spec_num_accepted_tokens = self._add(
            Counter, "spec_decode_num_accepted_tokens_total",
            "Draft tokens accepted.").labels(m)
        self.spec_accepted_per_pos = self._add(
            Counter, "spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by position in the step's drafts (0 = first).",
            ("position",))
        self.spec_chosen_k = self._add(
            Counter, "spec_decode_chosen_k_total",
            "Sampling requests by the k drafts the draft policy had them propose.", ("k",))
        self.spec_share_steps_k0 = self._add(
            Gauge, "spec_decode_share_steps_k0",
            "Share of steps with sampling requests in which none proposed a draft.").labels(m)
        self.step_seconds_predicted = self._add(
            Gauge, "step_seconds_predicted",
            "The goodput policy's predicted time of the last timed step.").labels(m)
        self.step_seconds_measured = self._add(
            Gauge, "step_seconds_measured", "The runner's measured time of that step.").labels(m)
        self.step_seconds_abs_error = self._add(
            Gauge, "step_seconds_mean_abs_error",
            "Mean |predicted - measured| step time since start.").labels(m)
        self.step_stalls = self._add(
            Gauge, "step_seconds_stall_steps",
            "Timed steps the goodput policy's time model took for stalls (far over their "
            "price after calm steps) and fitted at a cap.").labels(m)
        self.spec_request_weight = self._add(
            Gauge, "spec_decode_request_weight",
            "Verifications a request's own acceptance record needs before it counts, as "
            "finished requests' spread says.").labels(m)
        self.spec_shadow_checks = self._add(
            Counter, "spec_decode_shadow_checks",
            "Parked requests' shadow drafts checked against the token they sampled "
            "next (ngram under the goodput policy; never verified).").labels(m)
        self.spec_shadow_hits = self._add(
            Counter, "spec_decode_shadow_hits",
            "... of which the request sampled the draft.").labels(m)

    def _make_histograms(self) -> None:
        m = self.model_name
        self.ttft = self._add(Histogram, "time_to_first_token_seconds",
                              "Time to first token.", buckets=TTFT_BUCKETS).labels(m)
        self.itl = self._add(Histogram, "inter_token_latency_seconds",
                             "Inter-token latency.", buckets=ITL_BUCKETS).labels(m)
        self.tpot = self._add(Histogram, "request_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=ITL_BUCKETS).labels(m)
        self.e2e = self._add(Histogram, "e2e_request_latency_seconds",
                             "End-to-end request latency.", buckets=E2E_BUCKETS).labels(m)
        self.request_prompt_tokens = self._add(
            Histogram, "request_prompt_tokens", "Prompt tokens per finished request.",
            buckets=TOKEN_BUCKETS).labels(m)
        self.request_generation_tokens = self._add(
            Histogram, "request_generation_tokens", "Generated tokens per finished request.",
            buckets=TOKEN_BUCKETS).labels(m)
        self.budget_pass_rows = self._add(
            Histogram, "budget_pass_rows",
            "Rows each forward pass (target, drafter passes) built per step.",
            ("pass",), buckets=ROW_BUCKETS)

    def unregister(self) -> None:
        """Remove every metric of this instance from its registry."""
        for collector in self._collectors:
            self.registry.unregister(collector)
        self._collectors.clear()

    # ---- the hook ----------------------------------------------------------------

    def on_step(self, core: CoreView, deltas: Sequence[RequestDelta],
                latency: Mapping[str, LatencySample]) -> None:
        """AsyncEngine hook: gauges now, counters by this step's increments."""
        sched = core.scheduler
        self.num_requests_running.set(len(sched.running))
        self.num_requests_waiting.set(len(sched.waiting))
        self.kv_cache_usage_perc.set(sched.kv_cache_usage())
        self.on_requests(deltas, latency)
        self.on_stats(sched.stats)
        self.on_pass_rows(getattr(core.runner, "last_pass_rows", {}),
                          core.config.max_num_batched_tokens)

    def on_requests(self, deltas: Sequence[RequestDelta],
                    latency: Mapping[str, LatencySample]) -> None:
        """Token and request counters and latency histograms from one step's deltas."""
        for delta in deltas:
            new = len(delta.new_token_ids)
            self.generation_tokens.inc(new)
            if new and delta.num_output_tokens == new:  # the request's first tokens
                self.prompt_tokens.inc(delta.num_prompt_tokens)
            if delta.finished:
                reason = delta.finish_reason or "abort"
                self.request_success.labels(self.model_name, reason).inc()
                self.request_prompt_tokens.observe(delta.num_prompt_tokens)
                self.request_generation_tokens.observe(delta.num_output_tokens)
        for sample in latency.values():
            if sample.ttft is not None:
                self.ttft.observe(sample.ttft)
            for gap in sample.itl:
                self.itl.observe(gap)
            if sample.e2e is not None:
                self.e2e.observe(sample.e2e)
            if sample.tpot is not None:
                self.tpot.observe(sample.tpot)

    def on_stats(self, stats: SchedulerStats) -> None:
        """Add what the scheduler's cumulative counts gained since the last call. Counts
        that went back (a restarted engine process starts again from zero) count from
        zero, as Prometheus counters do across a reset: the totals keep growing."""
        seen, spec = self._seen, stats.spec
        if stats.num_steps < seen.num_steps:
            seen = _SeenStats()
        self.num_preemptions.inc(stats.num_preemptions - seen.num_preemptions)
        self.spec_num_drafts.inc(spec.num_drafts - seen.num_drafts)
        self.spec_num_draft_tokens.inc(spec.num_draft_tokens - seen.num_draft_tokens)
        self.spec_num_accepted_tokens.inc(spec.num_accepted_tokens - seen.num_accepted_tokens)
        per_pos = spec.num_accepted_tokens_per_pos
        for pos, total in enumerate(per_pos):
            before = seen.accepted_per_pos[pos] if pos < len(seen.accepted_per_pos) else 0
            # inc(0) still creates the position's series, so every position shows.
            self.spec_accepted_per_pos.labels(self.model_name, str(pos)).inc(total - before)
        goodput = stats.goodput
        self._on_goodput(goodput, seen.chosen_k)
        self.spec_shadow_checks.inc(goodput.shadow_checks - seen.shadow_checks)
        self.spec_shadow_hits.inc(goodput.shadow_hits - seen.shadow_hits)
        self._seen = _SeenStats(stats.num_preemptions, spec.num_drafts, spec.num_draft_tokens,
                                spec.num_accepted_tokens, list(per_pos),
                                list(goodput.chosen_k), stats.num_steps,
                                goodput.shadow_checks, goodput.shadow_hits)

    def _on_goodput(self, goodput: GoodputStats, seen_k: list[int]) -> None:
        """The draft policy's choices and its step-time predictions."""
        for k, total in enumerate(goodput.chosen_k):
            before = seen_k[k] if k < len(seen_k) else 0
            self.spec_chosen_k.labels(self.model_name, str(k)).inc(total - before)
        if goodput.share_steps_k0 is not None:
            self.spec_share_steps_k0.set(goodput.share_steps_k0)
        if goodput.last_predicted_seconds is not None:
            self.step_seconds_predicted.set(goodput.last_predicted_seconds)
        if goodput.last_measured_seconds is not None:
            self.step_seconds_measured.set(goodput.last_measured_seconds)
        if goodput.request_weight is not None:
            self.spec_request_weight.set(goodput.request_weight)
        self.step_stalls.set(goodput.stall_steps)
        error = goodput.as_dict()["mean_abs_error_seconds"]
        if isinstance(error, float):
            self.step_seconds_abs_error.set(error)

    def on_pass_rows(self, pass_rows: Mapping[str, int], budget: int) -> None:
        """Rows of every forward pass of the last step; a pass it did not run reads 0."""
        self._pass_names.update(pass_rows)
        for name in sorted(self._pass_names):
            rows = pass_rows.get(name, 0)
            if name in pass_rows:
                self.budget_pass_rows.labels(self.model_name, name).observe(rows)
            self.budget_pass_utilization.labels(self.model_name, name).set(rows / budget)


def wire_step_metrics(hooks: list[Any], registry: CollectorRegistry,
                      model_name: str) -> Callable[[], None]:
    """`EngineMetrics` on `registry`, its `on_step` added to an engine's step hooks;
    returns the undo (unhooked and unregistered)."""
    metrics = EngineMetrics(registry, model_name)
    hooks.append(metrics.on_step)

    def unwire() -> None:
        if metrics.on_step in hooks:
            hooks.remove(metrics.on_step)
        metrics.unregister()

    return unwire
