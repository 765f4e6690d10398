"""The side-by-side benchmark against vLLM's scheduler: its trace has the properties
it was built for (arrivals, long prompts, preemption), our side drains it, and (where
.vllm-venv exists) vLLM's side replays the same trace to the same tokens."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from benchmarks import scheduler_vs_vllm
from benchmarks.sched_trace import (
    OutputLog,
    TimedStep,
    Trace,
    TraceConfig,
    make_trace,
    replay,
    summarize,
)

CFG = TraceConfig(num_running=64, seed=3)


@pytest.fixture(scope="module")
def trace() -> Trace:
    return make_trace(CFG)


def test_trace_is_deterministic_per_seed(trace: Trace) -> None:
    assert make_trace(CFG).to_json() == trace.to_json()
    assert make_trace(TraceConfig(64, seed=4)).fingerprint() != trace.fingerprint()
    assert Trace.from_json(trace.to_json()).fingerprint() == trace.fingerprint()


def test_trace_shape(trace: Trace) -> None:
    reqs, cfg = trace.requests, trace.config
    assert len(reqs) == 4 * cfg.num_running
    assert sum(r.arrival_step == 0 for r in reqs) == cfg.num_running  # the burst
    assert trace.max_num_batched_tokens == 16 * cfg.num_running
    # A quarter open with a 64-token prefix that other requests share.
    groups = Counter(tuple(r.prompt_token_ids[:cfg.prefix_len]) for r in reqs)
    shared = sum(count for count in groups.values() if count > 1)
    assert shared == round(cfg.prefix_share * len(reqs))
    # 1 % run into max_model_len; every other request ends on max_tokens before it.
    long = [r for r in reqs if len(r.prompt_token_ids) + r.max_tokens > cfg.max_model_len]
    assert len(long) == round(cfg.long_share * len(reqs))
    assert all(cfg.max_model_len - 64 <= len(r.prompt_token_ids) < cfg.max_model_len
               for r in long)
    rates = [r.acceptance for r in reqs]
    assert 0.3 <= min(rates) < 0.4 and 0.8 < max(rates) <= 0.9


def test_model_behaviour_is_a_function_of_the_trace(trace: Trace) -> None:
    req = trace.requests[0]
    assert req.emitted(10, 4) == req.emitted(10, 4)
    for position in range(50):
        tokens = req.emitted(position, 4)
        assert 1 <= len(tokens) <= 5 and tokens == req.emitted(position, 4)
        assert tokens[0] == req.token_id(position)
        assert req.emitted(position, 0) == [req.token_id(position)]  # nothing to verify
    accepted = sum(req.accepts(p) for p in range(4000)) / 4000
    assert abs(accepted - req.acceptance) < 0.05


def expected_output_tokens(trace: Trace) -> int:
    limit = trace.config.max_model_len
    return sum(min(r.max_tokens, limit - len(r.prompt_token_ids)) for r in trace.requests)


def test_ours_drains_the_trace_with_prefix_hits() -> None:
    trace = make_trace(TraceConfig(16, num_requests=48))
    side = scheduler_vs_vllm.OursSide(trace, "ngram")
    records = replay(trace, side)
    assert not side.sched.requests and side.log.num_tokens == expected_output_tokens(trace)
    assert side.sched.stats.num_prefix_hit_tokens > 0
    assert max(r.running for r in records) == trace.max_num_seqs


def test_ours_quick_reports_every_field(tmp_path: Path) -> None:
    report = scheduler_vs_vllm.main(["--quick", "--ours-only", "--out",
                                     str(tmp_path / "o.json")])
    assert (tmp_path / "o.json").exists()
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"off", "ngram", "parallel"}
    details = {d["method"]: d["ours"] for d in report["detail"]}
    total = expected_output_tokens(make_trace(TraceConfig(16, num_requests=32)))
    for method, row in rows.items():
        assert row["ours_us_per_step"] > 0 and row["ours_tokens_per_step"] > 0
        assert details[method]["output_tokens"] == total  # every request drained
        assert 0 < details[method]["steady_steps"] <= row["ours_steps_to_drain"]
        assert len(details[method]["running_curve"]) <= 100
    assert len({d["outputs_digest"] for d in details.values()}) == 1  # same model outcome
    assert rows["ngram"]["ours_steps_to_drain"] < rows["off"]["ours_steps_to_drain"]
    assert rows["parallel"]["ours_drafter_rows_per_step"] > 0
    assert rows["ngram"]["ours_drafter_rows_per_step"] == 0


def test_output_digest_sees_one_changed_token() -> None:
    a, b = OutputLog(), OutputLog()
    a.add("r", [1, 2, 3])
    b.add("r", [1, 2, 4])
    assert a.digest() != b.digest() and a.num_tokens == b.num_tokens


@pytest.mark.skipif(not scheduler_vs_vllm.VENV_PYTHON.exists(),
                    reason="no .vllm-venv (build it: bash ../shared/tools/vllm-scheduler-venv.sh)")
def test_vllm_side_quick_replays_the_same_outcomes(tmp_path: Path) -> None:
    report = scheduler_vs_vllm.main(["--quick", "--out", str(tmp_path / "v.json")])
    assert [r["method"] for r in report["results"]] == ["off", "ngram", "parallel"]
    for row in report["results"]:
        assert row["outputs_match"], row
        assert row["vllm_us_per_step"] > 0 and row["vllm_steps_to_drain"] > 0
        assert row["ratio"] == round(row["ours_us_per_step"] / row["vllm_us_per_step"], 3)
    rows = {r["method"]: r for r in report["results"]}
    # P-EAGLE in vLLM appends K - 1 rows to every scheduled request.
    assert rows["parallel"]["vllm_drafter_rows_per_step"] > rows["parallel"]["vllm_tokens_per_step"]
    assert rows["off"]["vllm_drafter_rows_per_step"] == 0


def test_missing_venv_says_how_to_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_vs_vllm, "VENV_PYTHON", Path("/nonexistent/python"))
    with pytest.raises(SystemExit, match=r"vllm-scheduler-venv\.sh"):
        scheduler_vs_vllm.main(["--quick"])


def test_baseline_side_runs_the_revision_on_the_same_trace(tmp_path: Path) -> None:
    """HEAD as the baseline: a worktree of it replays the same trace in a subprocess
    (its scheduler imported from the worktree, checked) and decides the same."""
    report = scheduler_vs_vllm.main(["--quick", "--ours-only", "--baseline", "HEAD",
                                     "--methods", "ngram", "--out", str(tmp_path / "b.json")])
    (row,) = report["results"]
    assert row["same_as_before"] and row["before_us_per_step"] > 0 and row["speedup"] > 0
    assert report["detail"][0]["before"]["outputs_digest"] == \
        report["detail"][0]["ours"]["outputs_digest"]


def test_priority_policy_drains_with_the_same_outcomes(tmp_path: Path) -> None:
    trace = make_trace(TraceConfig(16, num_requests=32))
    assert len({r.priority() for r in trace.requests}) > 1
    logs = []
    for policy in ("fcfs", "priority"):
        side = scheduler_vs_vllm.OursSide(trace, "ngram", policy)
        replay(trace, side)
        assert not side.sched.requests
        logs.append(side.log)
    # The trace alone decides each request's tokens, whatever order they ran in.
    assert logs[0].digest() == logs[1].digest()
    assert logs[1].num_tokens == expected_output_tokens(trace)


def test_scaling_slope_reads_the_curve() -> None:
    rows = [{"method": "off", "n_running": n, "ours_us_per_step": us}
            for n, us in ((64, 100.0), (256, 400.0), (1024, 1600.0))]
    rows += [{"method": "ngram", "n_running": n, "ours_us_per_step": us}
             for n, us in ((64, 100.0), (1024, 3200.0))]
    curves = scheduler_vs_vllm.scaling(rows)["ours"]
    assert curves["off"]["loglog_slope"] == 1.0  # linear
    assert curves["off"]["us_per_running_request"] == [1.56, 1.56, 1.56]
    assert curves["ngram"]["loglog_slope"] == 1.25  # worse than linear


def test_draft_update_figure_covers_the_same_steady_steps() -> None:
    """vLLM's draft update is added over the steps `us_per_step` covers, not all."""
    trace = make_trace(TraceConfig(10, num_requests=10))
    records = [TimedStep(100.0, 50.0, 10.0, 1, 0, 10) for _ in range(3)]
    records += [TimedStep(1.0, 1.0, 0.0, 1, 0, 1) for _ in range(5)]  # burst tail
    log = OutputLog()
    log.add("r", [1])
    summary = summarize(trace, records, log)
    assert summary["us_per_step"]["median"] == 150.0
    assert summary["us_per_step_with_draft_update"]["median"] == 160.0
