"""The benchmarks run (quick mode) and report what they claim; no timing thresholds."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks import scheduler_overhead, throttle_tightness
from tests.helpers import needs_compiler


def test_scheduler_overhead_quick(tmp_path: Path) -> None:
    report = scheduler_overhead.main(["--quick", "--out", str(tmp_path / "o.json")])
    assert (tmp_path / "o.json").exists()
    methods = {row["method"] for row in report["results"]}
    assert methods == {"off", "eagle", "dflash"}
    assert all(row["median_us"] > 0 for row in report["results"])


def test_scheduler_ab_against_head_quick(tmp_path: Path) -> None:
    """The two-tree A/B runs (against HEAD itself here) and reports every ratio."""
    from benchmarks import scheduler_ab

    report = scheduler_ab.main(["--quick", "--base", "HEAD", "--out", str(tmp_path / "a.json")])
    assert [row["method"] for row in report["results"]] == ["off", "eagle", "dflash"]
    for row in report["results"]:
        assert row["base_median_us"] > 0 and row["head_median_us"] > 0
        assert row["ratio_median_us"] == round(row["head_median_us"] / row["base_median_us"], 3)


def test_throttle_tightness_quick(tmp_path: Path) -> None:
    report = throttle_tightness.main(["--quick", "--out", str(tmp_path / "t.json")])
    rows = [r for r in report["results"] if r["status"] == "ok"]
    assert {r["rule"] for r in rows} == {"ours", "vllm_static", "vllm_flat"}
    for row in rows:  # every rule stayed inside B in every pass the runner built
        assert row["over_budget_steps"] == 0
        assert row["max_target_rows_built"] <= row["max_num_batched_tokens"]
        assert row["max_drafter_rows_built"] <= row["max_num_batched_tokens"]
    ours = {(r["method"], r["k"]): r for r in rows if r["rule"] == "ours"}
    for row in rows:  # on dflash, a reserving rule never drains sooner (step counts)
        if row["method"] == "dflash" and row["rule"] != "ours":
            assert ours[("dflash", row["k"])]["steps_to_drain"] <= row["steps_to_drain"]


@pytest.mark.model
def test_runner_step_quick(tmp_path: Path) -> None:
    from benchmarks import runner_step

    report = runner_step.main(["--quick", "--device", "cpu", "--out", str(tmp_path / "r.json")])
    cases = [row["case"] for row in report["results"]]
    assert cases == ["decode x1", "decode x8", "decode x32", "prefill 128",
                     "draft V=8192 x1", "draft V=8192 x8", "draft V=49152 x1",
                     "draft V=49152 x8"]
    for row in report["results"]:
        assert row["step_ms"] > 0 and 0 < row["prepare_fraction"] < 1
        assert ("draft_ms" in row) == row["case"].startswith("draft")


@pytest.mark.model
def test_runner_step_refuses_to_time_drafting_that_did_not_happen() -> None:
    """The draft rows time real drafts: a drafter that proposes nothing (ngram on
    prompts without a repeated n-gram) makes the benchmark raise, not report ~0 ms."""
    import torch

    from benchmarks import runner_step
    from runner.model_loader import load_model
    from runner.model_prep import resolve_model
    from spec_decode import SpeculativeConfig

    model = load_model(resolve_model(None), torch.float32, torch.device("cpu"))
    spec = SpeculativeConfig("ngram", 2, draft_policy="fixed")
    with pytest.raises(RuntimeError, match="verified no drafts"):
        runner_step.bench_decode(model, "cpu", 1, 2, spec, "ngram")


@pytest.mark.gpu
@pytest.mark.model
def test_runner_step_and_spec_decode_on_cuda(tmp_path: Path) -> None:
    """The GPU figures' two benchmarks run on CUDA: the runner's phases, and served
    speculation token-identical to off with the engine on the GPU."""
    from benchmarks import runner_step, spec_decode

    report = runner_step.main(["--quick", "--device", "cuda", "--out", str(tmp_path / "r.json")])
    assert report["device"] == "cuda"
    assert all(row["draft_ms"] > 0 for row in report["results"] if "draft_ms" in row)
    report = spec_decode.main(["--quick", "--device", "cuda", "--methods", "ngram",
                               "--workloads", "grounded", "--dtype", "auto",
                               "--out", str(tmp_path / "s.json")])
    assert report["device"] == "cuda" and report["dtype"] == "bfloat16"
    assert all(r["lossless"] for r in report["results"])


@pytest.mark.model
def test_spec_decode_quick(tmp_path: Path) -> None:
    from benchmarks import spec_decode

    report = spec_decode.main(["--quick", "--methods", "ngram,draft_model",
                               "--workloads", "grounded", "--goodput-k", "2,4",
                               "--out", str(tmp_path / "s.json")])
    rows = report["results"]
    assert {r["method"] for r in rows} == {"off", "ngram", "draft_model"}
    assert all(r["lossless"] for r in rows)  # every policy's output is speculation off's
    assert {r["draft_policy"] for r in rows if r["method"] != "off"} == {"goodput", "fixed"}
    summary = {(s["method"], s["concurrency"], s["goodput_k"]): s
               for s in report["policy_summary"]}
    assert len(summary) == len(report["policy_summary"])  # one entry per goodput K
    assert set(summary) == {(m, c, k) for m in ("ngram", "draft_model") for c in (1, 4)
                            for k in (2, 4)}
    for entry in summary.values():
        assert entry["best_fixed_k"] == 4 and entry["goodput_vs_best_fixed"] > 0
    for row in rows:
        if row["method"] != "draft_model":
            continue
        # The target drafting for itself: every draft accepted. Under goodput it may
        # never draft (a draft costs a whole target pass), its requests parked.
        if row["draft_policy"] == "fixed":
            assert row["acceptance_rate"] == 1.0
            assert row["theoretical_tokens_per_step"] == 5.0
        else:
            assert row["acceptance_rate"] in (None, 1.0)


@pytest.mark.model
def test_spec_decode_paired_steps(tmp_path: Path) -> None:
    """Each configuration beside its own run of off, step by step: one twin of off per
    configuration and pass, both lossless, each timed by its own steps."""
    from benchmarks import spec_decode

    report = spec_decode.main(["--quick", "--methods", "ngram,suffix", "--workloads",
                               "grounded", "--policies", "goodput", "--concurrency", "4",
                               "--paired-steps", "--repeats", "2",
                               "--out", str(tmp_path / "s.json")])
    rows = {r["method"]: r for r in report["results"]}
    assert report["paired_steps"] and set(rows) == {"off", "ngram", "suffix"}
    assert len(rows["off"]["tokens_per_s_runs"]) == 4  # two configurations, two passes
    assert all(r["lossless"] and r["speedup_vs_off"] > 0 for r in rows.values())
    assert all(r["seconds"] > 0 and r["steps"] > 0 for r in rows.values())


@pytest.mark.model
def test_spec_decode_side_by_side_runs_every_configuration_in_each_pass(
        tmp_path: Path) -> None:
    """`--side-by-side`: off, goodput and two fixed K step together each pass: one run
    of each per pass (off too), every one lossless against off, and each ratio against
    the off of its own pass."""
    from benchmarks import spec_decode

    report = spec_decode.main(["--quick", "--methods", "ngram", "--workloads", "grounded",
                               "--policies", "goodput,fixed", "--k-grid", "1,2",
                               "--concurrency", "2", "--side-by-side", "--repeats", "2",
                               "--out", str(tmp_path / "s.json")])
    rows = report["results"]
    assert report["side_by_side"] and len(rows) == 4
    assert all(len(r["tokens_per_s_runs"]) == 2 for r in rows)  # off: one run a pass
    assert all(r["lossless"] and r["steps"] > 0 for r in rows)
    off = rows[0]["tokens_per_s_runs"]
    for row in rows[1:]:
        ratios = sorted(t / o for t, o in zip(row["tokens_per_s_runs"], off, strict=True))
        assert row["speedup_vs_off"] == pytest.approx(sum(ratios) / 2, abs=1e-3)


@pytest.mark.model
def test_spec_decode_serve_first_measures_only_the_batch_after(tmp_path: Path) -> None:
    """With --serve-first each engine serves training-split instructions first, left
    out of every figure: off takes the measured batch's steps either way, and the
    policy's chosen k counts only the measured steps."""
    from benchmarks import spec_decode
    from training.prompts import instructions

    args = ["--quick", "--methods", "ngram", "--workloads", "held-out", "--policies",
            "goodput", "--concurrency", "4", "--paired-steps"]
    cold = spec_decode.main([*args, "--out", str(tmp_path / "cold.json")])
    warm = spec_decode.main([*args, "--serve-first", "--out", str(tmp_path / "warm.json")])
    assert warm["served_first"] and not cold["served_first"]
    rows = [{r["method"]: r for r in report["results"]} for report in (cold, warm)]
    assert rows[0]["off"]["steps"] == rows[1]["off"]["steps"]
    for row in (r["ngram"] for r in rows):
        assert row["lossless"]
        assert sum(row["chosen_k"]) <= row["steps"] * 4  # one k per sampling request-step
    prompts, _ = spec_decode.served_first(8, 8)
    assert len(set(prompts)) == 8 and not set(prompts) & set(instructions("eval"))


def test_spec_decode_rotates_its_passes() -> None:
    """Each pass runs every configuration once, and over the passes a configuration
    runs at different places in the pass (not always first, not always last)."""
    from benchmarks.spec_decode import pass_order

    orders = [pass_order(11, r, 3) for r in range(3)]
    assert all(sorted(order) == list(range(11)) for order in orders)
    for config in range(11):
        places = {order.index(config) for order in orders}
        assert len(places) == 3 and max(places) - min(places) >= 3
    assert pass_order(5, 0, 1) == [0, 1, 2, 3, 4]


def test_spec_decode_pairs_each_pass_with_off_in_the_same_pass() -> None:
    """A slow pass slows both: the pass's own ratios decide, not the medians'."""
    from benchmarks.spec_decode import paired_speedup

    off = [{"tokens_per_s": t} for t in (400.0, 300.0, 420.0)]
    spec = [{"tokens_per_s": t} for t in (380.0, 290.0, 300.0)]  # pass 3 ran slow for it
    # Ratios 0.95, 0.967, 0.714: median 0.95; the medians' ratio would say 300/400 = 0.75.
    assert paired_speedup(spec, off) == 0.95
    with pytest.raises(ValueError):  # a run lost from one side is an error, not a shift
        paired_speedup(spec[:2], off)


@pytest.mark.model
def test_throttle_e2e_quick(tmp_path: Path) -> None:
    """The real model under each rule with the goodput policy and ours with the fixed
    one: outputs identical, every figure reported, the static reservation's smaller
    target budget is the one it ran, and each row is compared with ours (same policy)
    and with its rule under the other policy."""
    from benchmarks import throttle_e2e

    report = throttle_e2e.main(["--quick", "--methods", "dflash:2", "--rounds", "2",
                                "--out", str(tmp_path / "e.json")])
    assert (tmp_path / "e.png").stat().st_size > 0
    rows = {(row["rule"], row["draft_policy"]): row for row in report["results"]}
    assert set(rows) == {("ours", "goodput"), ("vllm_flat", "goodput"),
                         ("vllm_static", "goodput"), ("ours", "fixed")}
    work = report["workload"]
    for row in rows.values():
        assert row["status"] == "ok" and row["identical_outputs"]
        assert len(row["rounds_tokens_per_s"]) == 2
        assert row["output_tokens"] == work["num_requests"] * work["max_tokens"]
        assert row["steps"] > 0 and row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert 0 < row["target_rows_per_step"] <= work["budget"]
    # The fixed policy decides without a clock: its rounds must agree.
    assert rows["ours", "fixed"]["same_decisions_every_round"]
    assert sum(rows["ours", "goodput"]["chosen_k"]) > 0
    # dflash K=2: S = K + 1 = 3 rows reserved per sequence under the static rule.
    static = rows["vllm_static", "goodput"]
    assert static["target_budget"] == work["budget"] - 3 * work["max_num_seqs"]
    assert rows["ours", "goodput"]["target_budget"] == work["budget"]
    assert set(static["ours_vs_this"]) == {"tokens_per_s", "steps"}
    assert rows["ours", "fixed"]["vs_other_policy"]["policy"] == "goodput"
    assert "ours_vs_this" not in rows["ours", "goodput"]


def test_throttle_e2e_rotates_config_order() -> None:
    """Every configuration goes first once in as many rounds, and each round runs all."""
    from benchmarks.throttle_e2e import DEFAULT_CONFIGS, parse_configs, rotated

    configs = parse_configs(DEFAULT_CONFIGS)
    orders = [rotated(configs, r) for r in range(len(configs))]
    assert {order[0] for order in orders} == set(configs)
    assert all(sorted(order) == sorted(configs) for order in orders)


def test_throttle_e2e_refuses_an_unknown_config() -> None:
    from benchmarks.throttle_e2e import parse_configs

    for bad in ("ours", "vllm:goodput", "ours:greedy"):
        with pytest.raises(ValueError, match="rule:policy"):
            parse_configs(bad)


def test_throttle_e2e_merge_flags_rounds_that_decided_differently() -> None:
    """Rounds that took different steps are reported, not hidden by the median."""
    from benchmarks.throttle_e2e import merge_rounds

    base = {"status": "ok", "output_tokens_per_s": 10.0, "ttft_p50_s": 1.0,
            "ttft_p99_s": 2.0, "seconds": 5.0, "steps": 7, "outputs": {"0": [1, 2]}}
    same = merge_rounds([base, dict(base, output_tokens_per_s=12.0), dict(base)])
    assert same["same_decisions_every_round"] and same["output_tokens_per_s"] == 10.0
    assert same["rounds_tokens_per_s"] == [10.0, 12.0, 10.0]
    assert not merge_rounds([base, dict(base, steps=8)])["same_decisions_every_round"]
    assert not merge_rounds([base, dict(base, outputs={"0": [1, 3]})])[
        "same_decisions_every_round"]


def test_scheduler_work_counts_calls_per_request(tmp_path: Path) -> None:
    from benchmarks import scheduler_work

    report = scheduler_work.main(["--quick", "--methods", "off,ngram", "--out",
                                  str(tmp_path / "w.json")])
    rows = {r["method"]: r for r in report["results"]}
    assert all(r["steady_steps"] > 0 and r["calls_per_running_request"] > 1
               for r in rows.values())
    # Drafts make more work per request than speculation off.
    assert rows["ngram"]["calls_per_running_request"] > rows["off"]["calls_per_running_request"]


def test_serve_overhead_summary_takes_medians_per_concurrency() -> None:
    from benchmarks.serve_overhead import summary

    def run(tput: float, ttft: float = 10.0) -> dict:
        pct = {"p50": ttft, "p99": 2 * ttft}
        return {"output_throughput": tput, "ttft_ms": pct, "itl_ms": pct, "failed": 0}

    offline = [{"output_throughput": t} for t in (50, 400, 60, 380, 55, 390)]  # 3 repeats
    served = {"in-process": [[run(20), run(200)], [run(30), run(190)], [run(25), run(210)]],
              "process": [[run(55, 5.0), run(380)], [run(60), run(360)],
                          [run(50), run(370)]]}
    rows = summary(offline, served, [1, 16])
    assert [r["offline_tok_s"] for r in rows] == [55, 390]
    assert rows[0]["in-process"]["tok_s"] == 25 and rows[1]["process"]["tok_s"] == 370
    # Each repeat's own ratio, then their median: 55/50, 60/60, 50/55 -> 1.0.
    assert rows[0]["process"]["served_over_offline"] == 1.0
    # 200/400, 190/380, 210/390 -> 0.5; the ratio of the medians would be 200/390.
    assert rows[1]["in-process"]["served_over_offline"] == 0.5
    assert rows[1]["in-process"]["ratio_of_medians"] == round(200 / 390, 3)
    assert rows[0]["process"]["ttft_p50_ms"] == 10.0  # the median of 5, 10, 10


@pytest.mark.model
def test_serve_overhead_quick_serves_every_layout(tmp_path: Path) -> None:
    from benchmarks import serve_overhead

    layouts = ["in-process", "process", "ray-2"]
    report = serve_overhead.main(["--quick", "--concurrency", "2", "--max-tokens", "4",
                                  "--layouts", ",".join(layouts),
                                  "--out", str(tmp_path / "o.json")])
    (row,) = report["summary"]
    assert row["offline_tok_s"] > 0
    for layout in layouts:
        assert row[layout]["tok_s"] > 0 and row[layout]["failed"] == 0
    assert (tmp_path / "o.png").exists()


def test_serve_overhead_refuses_an_unknown_layout(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import serve_overhead

    with pytest.raises(SystemExit):
        serve_overhead.main(["--layouts", "process,ray2"])
    assert "--layouts: unknown ['ray2']" in capsys.readouterr().err


@pytest.mark.model
def test_cpu_forward_quick(tmp_path: Path) -> None:
    """Rows per pass, quality against float32, the engine's figures and the llama.cpp
    row (skipped, and said so, without its venv); against HEAD as the baseline."""
    from benchmarks import cpu_forward

    report = cpu_forward.main(["--quick", "--dtypes", "float32,bfloat16,int8",
                               "--engine-dtypes", "int8", "--baseline", "HEAD",
                               "--llamacpp-python", str(tmp_path / "none"),
                               "--out", str(tmp_path / "c.json")])
    assert (tmp_path / "c.png").exists()
    assert [s["requested"] for s in report["rows"]] == ["float32", "bfloat16", "int8"]
    assert report["rows"][2]["kernel"] == "fbgemm-int8 (row-invariant)"
    assert all(s["ratio_to_1"]["1"] == 1.0 for s in report["rows"])
    assert [q["dtype"] for q in report["quality"]] == ["bfloat16", "int8"]
    assert all(0.5 < q["top1_agreement"] <= 1.0 for q in report["quality"])
    (engine,) = report["engine"]
    assert engine["quantization"] == "int8"
    assert engine["grounded_ngram_equal_to_off"] and engine["decode_tok_s"] > 0
    assert report["baseline"]["rev"] == "HEAD" and report["baseline"]["decode_tok_s"] > 0
    assert "not found" in report["llamacpp"]["skipped"]


@pytest.mark.model
def test_greedy_equality_quick(tmp_path: Path) -> None:
    from benchmarks import greedy_equality

    report = greedy_equality.main(["--quick", "--methods", "ngram,eagle",
                                   "--out", str(tmp_path / "g.json")])
    rows = report["results"]
    assert [(r["method"], r["concurrency"]) for r in rows] == [
        ("ngram", 1), ("ngram", 16), ("eagle", 1), ("eagle", 16)]
    assert all(r["equal"] == r["requests"] == 3 and r["match"] == 1.0 for r in rows)
    assert rows[2]["drafter"] in ("random", "default")


def test_greedy_equality_reports_where_outputs_diverge() -> None:
    from benchmarks.greedy_equality import compare

    report = compare([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9], [6, 7]])
    assert report["equal"] == 1 and report["match"] == 0.3333
    assert report["divergences"] == [{"prompt": 1, "first_differing_token": 1},
                                     {"prompt": 2, "first_differing_token": 1}]


def test_decision_digest_is_deterministic_and_sees_a_change(tmp_path: Path) -> None:
    """Two runs of one seed agree (so equal digests across commits mean equal
    decisions); another seed, another workload, another digest."""
    from benchmarks import decision_digest

    runs = [decision_digest.main(["--cases", "4", "--seed", str(seed), "--out",
                                  str(tmp_path / f"d{i}.json")])
            for i, seed in enumerate((1, 1, 2))]
    assert runs[0]["digest"] == runs[1]["digest"] != runs[2]["digest"]


def test_decision_digest_sees_a_changed_decision(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler that decides otherwise (prefill chunks capped at 8 tokens, still
    valid) gives another digest for the same seed."""
    from benchmarks import decision_digest
    from scheduler.scheduler import Scheduler

    args = ["--cases", "4", "--out", str(tmp_path / "d.json")]
    before = decision_digest.main(args)["digest"]
    monkeypatch.setattr(Scheduler, "_max_chunk", lambda self, pending: min(pending, 8))
    assert decision_digest.main(args)["digest"] != before


def test_decision_digest_sees_goodput(tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Goodput's cases are in the digest (leaving them out changes it), and a goodput
    policy that decides otherwise (one k fewer for every drafting request, still
    valid) gives another digest: a goodput refactor is checked like any other."""
    import numpy as np

    from benchmarks import decision_digest
    from scheduler.goodput import GoodputPolicy

    args = ["--cases", "12", "--out", str(tmp_path / "d.json")]
    before = decision_digest.main(args)["digest"]
    assert decision_digest.main([*args, "--no-goodput"])["digest"] != before
    caps = GoodputPolicy.caps

    def one_fewer(self: GoodputPolicy, *a: object, **kw: object) -> np.ndarray:
        return np.maximum(caps(self, *a, **kw) - 1, 0)

    monkeypatch.setattr(GoodputPolicy, "caps", one_fewer)
    assert decision_digest.main(args)["digest"] != before


def test_goodput_cost_quick(tmp_path: Path) -> None:
    from benchmarks import goodput_cost

    report = goodput_cost.main(["--quick", "--methods", "ngram", "--out",
                                str(tmp_path / "g.json")])
    (row,) = report["results"]
    assert row["n_running"] == 16 and row["fixed_median_us"] > 0 and row["ratio"] > 0
    assert row["policy_us"] > 0
    assert row["fixed_plus_policy_ratio"] == pytest.approx(
        (row["fixed_median_us"] + row["policy_us"]) / row["fixed_median_us"], abs=1e-3)


def test_goodput_clock_quick(tmp_path: Path) -> None:
    """Goodput over off and over the best fixed K per seed, under each step prior, on
    the simulated GPU clock; the clock's drafter pass is its own."""
    from benchmarks import goodput_clock

    report = goodput_clock.main(["--quick", "--out", str(tmp_path / "c.json")])
    (cell,) = report["cells"]
    assert cell["method"] == "eagle" and set(cell["goodput"]) == {"cpu", "gpu"}
    for prior in cell["goodput"].values():
        assert len(prior["over_off"]) == report["seeds"] == 2
        best = [off / ratio for off, ratio in zip(prior["over_off"], prior["over_best_fixed"],
                                                  strict=True)]
        assert best == pytest.approx(cell["best_fixed_over_off"], rel=1e-3)
    # A drafter pass as dear as the target's (the clock's option reaches the runs):
    # the best fixed K gains less over off in every seed.
    dear = goodput_clock.main(["--quick", "--drafter-pass", "0.012",
                               "--out", str(tmp_path / "s.json")])
    assert all(d < c for d, c in zip(dear["cells"][0]["best_fixed_over_off"],
                                     cell["best_fixed_over_off"], strict=True))
    with pytest.raises(SystemExit):  # a clock no run could mean
        goodput_clock.main(["--quick", "--row", "-0.001", "--out", str(tmp_path / "x.json")])


@pytest.mark.model
def test_request_spread_quick(tmp_path: Path) -> None:
    """Each method's requests served alone at K = 1: counts per request, and the weight
    the scheduler's own estimator learns from them."""
    from benchmarks import request_spread

    report = request_spread.main(["--quick", "--methods", "ngram", "--out",
                                  str(tmp_path / "s.json")])
    ngram = report["methods"]["ngram"]
    assert report["prompts"] == 4 and ngram["requests"] <= 4
    assert 1.0 <= ngram["learnt_weight"] <= 64.0
    assert json.loads((tmp_path / "s.json").read_text())["methods"]["ngram"] == ngram


def test_request_spread_tells_alike_requests_from_spread_ones() -> None:
    """Forty requests at one rate learn the largest weight; half never accepting and
    half always, the smallest."""
    import numpy as np

    from benchmarks import request_spread

    verified = np.full(40, 30)
    rng = np.random.default_rng(0)
    alike = request_spread.spread_figures(verified, rng.binomial(30, 0.4, 40))
    apart = request_spread.spread_figures(verified, np.repeat([0, 30], 20))
    assert alike["learnt_weight"] == 64.0 and apart["learnt_weight"] == 1.0
    assert apart["dispersion"] > 10 * alike["dispersion"]


def _base_kernel_edited(monkeypatch: pytest.MonkeyPatch, old: str, new: str,
                        count: int = -1) -> None:
    """block_kernel's base build: this checkout's gemv_blocks.c with `old` (which it must
    hold) replaced by `new`, the first `count` times (all if -1)."""
    from benchmarks import block_kernel
    from runner.models import linear_blocks

    source = linear_blocks.SOURCE.read_text()
    assert old in source

    def edited(_rev: str, into: Path) -> Path:
        path = into / linear_blocks.SOURCE.name
        path.write_text(source.replace(old, new, count))
        return path

    monkeypatch.setattr(block_kernel, "base_source", edited)


@needs_compiler
def test_block_kernel_quick_keeps_bits_and_catches_a_build_that_does_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HEAD's kernel against this checkout's: every case timed on both builds and every
    output the same bits. A base whose wide path moves each input by 2^-20 of itself
    (gcc contracts a multiply then an add back into the FMA, so that twin would not
    differ) gives other bits at 6 and 16 rows, and the report says so."""
    from benchmarks import block_kernel
    from runner.models import linear_blocks

    if not linear_blocks.available():
        pytest.skip(f"no GGUF-block kernel here: {linear_blocks.load()[1]}")
    report = block_kernel.main(["--quick", "--out", str(tmp_path / "b.json")])
    assert json.loads((tmp_path / "b.json").read_text()) == report
    assert {c["rows"] for c in report["cases"]} == {1, 6, 16}
    assert all(c["base_ms"] > 0 and c["head_ms"] > 0 for c in report["cases"])
    assert report["all_same_bits"]

    # The first such line is the wide path's (`tile_rows`); the fused one's is alike.
    _base_kernel_edited(monkeypatch, "lo_acc[r] = _mm256_fmadd_ps(lo, xv, lo_acc[r]);",
                        "lo_acc[r] = _mm256_fmadd_ps(lo, _mm256_mul_ps(xv, _mm256_set1_ps("
                        "1.0f + 0x1p-20f)), lo_acc[r]);", count=1)
    broken = block_kernel.main(["--quick", "--out", str(tmp_path / "c.json")])
    assert not broken["all_same_bits"]
    assert {c["rows"] for c in broken["cases"] if not c["same_bits"]} == {6, 16}

    # The cold sweep through a (quick: one-layer) model, on both builds the same way.
    swept = block_kernel.main(["--quick", "--sweep", "--out", str(tmp_path / "d.json")])
    assert [c["rows"] for c in swept["cases"]] == [1, 6, 16]
    assert all(c["base_ms"] > 0 and c["head_gb_per_s"] > 0 for c in swept["cases"])
    assert {c["rows"] for c in swept["cases"] if not c["same_bits"]} == {6, 16}


@pytest.mark.model
@needs_compiler
def test_block_kernel_engine_quick_serves_each_engine_on_its_own_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--engine`: two engines sharing the model, each step on its own build. Against
    HEAD's kernel both answer alike; against a base whose fused path stores no sums the
    base engine's answers change and the head engine's do not, so each engine really
    ran its own build (a switch that stuck on one build would show both alike or both
    changed)."""
    from benchmarks import block_kernel
    from runner.models import linear_blocks

    if not linear_blocks.available():
        pytest.skip(f"no GGUF-block kernel here: {linear_blocks.load()[1]}")
    report = block_kernel.main(["--quick", "--engine", "--out", str(tmp_path / "e.json")])
    assert json.loads((tmp_path / "e.json").read_text()) == report
    assert [r["round"] for r in report["rounds"]] == [0, 1]
    for row in report["rounds"]:
        assert row["off"]["base_tok_s"] > 0 and row["off"]["head_tok_s"] > 0
        assert row["off"]["same_outputs"]

    _base_kernel_edited(monkeypatch, "_mm256_store_ps(acc + r * LANES, lo_acc[r]);",
                        "_mm256_store_ps(acc + r * LANES, _mm256_setzero_ps());")
    wrong = block_kernel.main(["--quick", "--engine", "--out", str(tmp_path / "f.json")])
    assert not any(row["off"]["same_outputs"] for row in wrong["rounds"])


@pytest.mark.model
@needs_compiler
def test_data_rate_quick(tmp_path: Path) -> None:
    """Both attention backends generate the same kind of data, and the rates are what
    the runs measured."""
    from benchmarks import data_rate

    report = data_rate.main(["--quick", "--out", str(tmp_path / "d.json")])
    assert set(report["runs"]) == {"cpu", "torch"}
    for runs in report["runs"].values():
        for run in runs:
            assert run["answer_tokens"] > 0 and run["labelled"] > 0
            assert run["tokens_per_s"] == pytest.approx(run["answer_tokens"] / run["seconds"],
                                                        rel=0.01, abs=0.1)
    assert report["ratio_to_cpu"]["cpu"] == 1.0


def test_update_rate_batches_are_full_when_windows_are_few() -> None:
    """Fewer windows than updates x 8 (a small --prompts): every batch still holds 8
    windows, each a real one, and every window is used before any repeats."""
    from benchmarks.update_rate import batch_indices

    batches = batch_indices(13, 4)
    assert [len(b) for b in batches] == [8, 8, 8, 8]
    flat = [int(i) for b in batches for i in b]
    assert all(0 <= i < 13 for i in flat)
    assert sorted(flat[:13]) == list(range(13))


@pytest.mark.model
def test_update_rate_quick(tmp_path: Path) -> None:
    """Live rows and every row give the same loss on the same batches, and the figures
    are the rounds' medians of each mode (AdamW unfused among them)."""
    from benchmarks import update_rate

    report = update_rate.main(["--quick", "--out", str(tmp_path / "u.json")])
    assert report["same_loss"] == {"eagle": True}
    runs = report["runs"]["eagle"]
    assert set(runs) == {"live", "all", "unfused"}
    for mode in ("live", "all", "unfused"):
        assert report["median_s_per_update"]["eagle"][mode] == statistics.median(runs[mode])
    assert 0.0 < report["labelled_share"] < 1.0  # prompt text and padding carry no label


@pytest.mark.model
@needs_compiler
def test_attention_engine_quick(tmp_path: Path) -> None:
    """Each concurrency runs both backends on the same requests and reports the ratio of
    what it measured and how many outputs matched."""
    from benchmarks import attention_engine

    report = attention_engine.main(["--quick", "--out", str(tmp_path / "e.json")])
    assert [row["concurrency"] for row in report["results"]] == [1, 2]
    for row in report["results"]:
        cpu, torch_rate = row["median_tok_s"]["cpu"], row["median_tok_s"]["torch"]
        assert cpu > 0 and torch_rate > 0
        assert row["cpu_over_torch"] == pytest.approx(cpu / torch_rate, rel=0.01)
        matched, total = map(int, row["identical_outputs"].split("/"))
        assert total == row["requests"] and 0 <= matched <= total


@pytest.mark.model
def test_goodput_ab_quick(tmp_path: Path) -> None:
    """Off, goodput, a variant and fixed K = 1 side by side: one ratio to off per engine
    per pass, the variant's overrides applied, every run token-identical to off."""
    from benchmarks import goodput_ab

    report = goodput_ab.main(["--runs", "ngram:2:2:1", "--variant",
                              "finish_min_running=1;finish_min_gain=0.0",
                              "--max-tokens", "8", "--out", str(tmp_path / "g.json")])
    assert report["variants"] == ["goodput", "finish_min_running=1;finish_min_gain=0.0",
                                  "fixed K=1"]
    (row,) = report["rows"]
    assert row["identical"] and row["requests"] == 2
    assert all(len(row["passes_vs_off"][n]) == 1 and row["median_vs_off"][n] > 0
               for n in report["variants"])
    assert json.loads((tmp_path / "g.json").read_text()) == report


def test_goodput_ab_refuses_a_setting_that_does_not_exist() -> None:
    """A misspelt setting would A/B the default against itself: refused by name."""
    from benchmarks import goodput_ab

    assert goodput_ab.parse_variant("finish_min_running=1") == {"finish_min_running": 1}
    with pytest.raises(SystemExit, match="finish_min_runing"):
        goodput_ab.parse_variant("finish_min_runing=1")


@pytest.mark.model
@needs_compiler
def test_norm_kernel_quick(tmp_path: Path) -> None:
    """Off, and eagle where a trained head is cached, each with the compiled norm and
    torch's, side by side; speculation equal to off under either norm."""
    from benchmarks import norm_kernel

    report = norm_kernel.main(["--quick", "--out", str(tmp_path / "n.json")])
    assert json.loads((tmp_path / "n.json").read_text()) == report
    for name, row in report["results"].items():
        assert row["compiled"]["tokens_per_s"] > 0 and row["torch"]["tokens_per_s"] > 0
        # each side really ran its norm (a switch the model no longer reads would time
        # the same norm twice)
        assert row["compiled"]["norms"] == ["CompiledNorm"]
        assert row["torch"]["norms"] == ["torch"]
        against = row["against_torch"]
        assert against["requests"] == report["prompts"]
        assert against["equal"] + len(against["divergences"]) == against["requests"]
        if name == "eagle":
            assert row["lossless_compiled"] and row["lossless_torch"]
    assert "off" in report["results"]


@pytest.mark.model
def test_decode_ab_quick_against_head(tmp_path: Path) -> None:
    """Both sides run (HEAD in a worktree against this checkout), each in its own
    process importing its own tree, and report tok/s and losslessness per side; a head
    method with `--random-heads` runs an untrained head (no trained one in CI's cache)."""
    from benchmarks import decode_ab

    report = decode_ab.main(["--quick", "--base", "HEAD", "--methods", "off,ngram,eagle",
                             "--random-heads", "--out", str(tmp_path / "d.json")])
    assert report["random_heads"]
    for method in ("ngram", "eagle"):
        row = report["results"][method]
        assert row["base"]["equal_to_off"] and row["head"]["equal_to_off"]
        assert all(x > 0 for side in ("base", "head") for x in row[side]["tokens_per_s"])
    assert report["base_commit"] == report["head"]  # HEAD is the checkout's commit


@pytest.mark.model
def test_decode_ab_refuses_a_side_that_imported_another_tree(tmp_path: Path) -> None:
    """A tree without the project's packages imports the installed checkout's: that
    run would measure the wrong side, and is refused."""
    from benchmarks import decode_ab

    with pytest.raises(RuntimeError, match="imported another checkout's engine"):
        decode_ab.measure(tmp_path, "off", 1, 2, 4)


def test_draft_starts_reads_each_verification_where_its_drafts_start() -> None:
    """Steps as the runner reports them: a prefill emitting one token and proposing
    drafts, a verification accepting two of them plus its bonus, one accepting none,
    and a last step past the answer's end (its drafts never verified)."""
    from benchmarks.draft_starts import served_starts

    steps = [([5], [6, 7, 8, 9]), ([6, 7, 1], [2, 3, 4, 5]), ([9], [10, 11, 12, 13])]
    assert served_starts(steps, answer_len=5) == [(1, 6, 2), (4, 2, 0)]
    # The check sees an off-by-one: counting from 0 emitted tokens moves every start.
    assert served_starts(steps, answer_len=5) != [(0, 6, 2), (3, 2, 0)]


@pytest.mark.model
def test_draft_starts_quick(tmp_path: Path) -> None:
    """Serving's first drafts are the teacher-forced ones (the drafter's state after a
    verification is what training computes), and the shares are shares. An untrained
    head (no trained one is needed here) drafts deterministically all the same."""
    from benchmarks import draft_starts

    report = draft_starts.main(["--quick", "--head", "random",
                                "--out", str(tmp_path / "s.json")])
    assert report["verifications"] > 0 and report["positions"] > 0
    assert report["served_first_equals_teacher_forced"] == 1.0
    assert report["served_first_accepted"] == report["teacher_forced_first_at_draft_starts"]
    assert 0.0 <= report["teacher_forced_first_at_every_position"] <= 1.0


@pytest.mark.model
def test_draft_confidence_quick(tmp_path: Path) -> None:
    """An untrained head is never confident: at threshold 0.5 every chain stops after
    its first draft, and with none given (`default`: a random head's 0) it runs to K;
    both lossless in both rounds, the ratio their median, the JSON the report."""
    from benchmarks import draft_confidence

    report = draft_confidence.main(["--quick", "--head", "random", "--thresholds",
                                    "0.5,default", "--policies", "fixed", "--k", "3",
                                    "--rounds", "2", "--out", str(tmp_path / "c.json")])
    assert json.loads((tmp_path / "c.json").read_text()) == report
    rows = report["results"]["fixed"]
    assert rows["0.5"]["lossless"] and rows["default"]["lossless"]
    assert sum(rows["default"]["drafted_per_position"][1:]) > 0
    assert rows["0.5"]["drafted_per_position"][0] > 0
    assert sum(rows["0.5"]["drafted_per_position"][1:]) == 0
    ratios = rows["0.5"]["speedup_vs_off_by_round"]
    assert len(ratios) == 2
    assert rows["0.5"]["speedup_vs_off"] == pytest.approx(sum(ratios) / 2, abs=1e-3)


@pytest.mark.model
def test_greedy_walk_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off, the sampler's path and the host walk side by side: every output equal to
    off's, one ratio a path, and the engine told to use the sampler does use it (the
    host walk's engine never calls it: greedy steps only)."""
    from benchmarks import greedy_walk
    from spec_decode.rejection_sampler import RejectionSampler

    calls = []
    forward = RejectionSampler.forward
    monkeypatch.setattr(RejectionSampler, "forward",
                        lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    report = greedy_walk.main(["--quick", "--head", "random", "--k", "2", "--rounds", "1",
                               "--out", str(tmp_path / "w.json")])
    assert json.loads((tmp_path / "w.json").read_text()) == report
    (only,) = report["rounds"]
    assert only["lossless"]
    assert only["sampler_over_off"] > 0 and only["host_walk_over_off"] > 0
    assert calls  # the sampler's engine verified through it


@pytest.mark.model
def test_draft_trees_quick(tmp_path: Path) -> None:
    """An untrained head's chain and trees (3 deep), two requests running: every output
    as off's, the tree's K its node count, the JSON the report."""
    from benchmarks import draft_trees

    report = draft_trees.main(["--quick", "--head", "random", "--shapes", "1;3,2",
                               "--depth", "3", "--concurrency", "2",
                               "--out", str(tmp_path / "t.json")])
    assert json.loads((tmp_path / "t.json").read_text()) == report
    chain, tree = report["results"]["1"], report["results"]["3,2"]
    assert chain["lossless"] and tree["lossless"]
    assert (chain["k"], tree["k"]) == (3, 7) and report["concurrency"] == 2
    assert chain["leaf_hits"] == 0 and tree["verifications"] > 0


@pytest.mark.model
def test_draft_trees_request_by_request(tmp_path: Path) -> None:
    """The engines taking turns a whole request at a time, two rounds: the same outputs
    as off's, the ratio the rounds' median."""
    from benchmarks import draft_trees

    report = draft_trees.main(["--quick", "--head", "random", "--shapes", "2",
                               "--depth", "2", "--interleave", "requests", "--rounds", "2",
                               "--out", str(tmp_path / "t.json")])
    assert report["interleave"] == "requests" and report["rounds"] == 2
    tree = report["results"]["2"]
    assert tree["lossless"] and tree["verifications"] > 0
    assert len(tree["speedup_per_round"]) == 2
    assert min(tree["speedup_per_round"]) <= tree["speedup_vs_off"] <= max(
        tree["speedup_per_round"])


@pytest.mark.parametrize("flag", ["--rounds", "--concurrency"])
def test_draft_trees_refuses_a_count_below_one(flag: str, capsys: pytest.CaptureFixture[str]
                                               ) -> None:
    from benchmarks import draft_trees

    with pytest.raises(SystemExit):
        draft_trees.main([flag, "0"])
    assert f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err
