"""`specbudget generate`, `serve` and `bench serve` (in-process, default model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.local_server import serve_in_thread
from runner.model_loader import load_model
from runner.model_prep import resolve_model
from runner.models.llama import LlamaForCausalLM
from spec_decode import SpeculativeConfig
from specbudget import cli


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return load_model(resolve_model(None), torch.float32, torch.device("cpu"))


@pytest.mark.model
def test_generate_without_arguments_runs_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("specbudget generate: smollm2-135m, speculative decoding ngram K=3")
    for i in range(1, len(cli.DEMO_PROMPTS) + 1):
        assert f"[{i}] prompt:" in out and f"[{i}] output (" in out
    spec = [line for line in out.splitlines() if line.startswith("spec decode:")]
    assert len(spec) == 1 and "acceptance rate" in spec[0]
    assert "mean acceptance length" in spec[0] and "per position [" in spec[0]


@pytest.mark.model
def test_generate_prompts_with_speculation_off(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "--prompt", "The capital of France is", "--prompt", "1 2 3",
                     "--max-tokens", "3", "--speculative-config", "null"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding off" in out and "chat template" not in out
    assert "[2] output (3 tokens, length)" in out
    assert "spec decode: no drafts verified" in out


def test_serve_arguments_build_the_engine_config() -> None:
    args = cli._parser().parse_args([
        "serve", "/models/llama", "--speculative-config",
        '{"method": "dflash", "num_speculative_tokens": 2, "draft_policy": "fit"}',
        "--max-num-batched-tokens", "128", "--max-num-seqs", "8", "--max-model-len", "1024",
        "--kv-cache-memory", "1.5G", "--block-size", "32", "--no-enable-prefix-caching",
        "--scheduling-policy", "priority", "--dtype", "bfloat16", "--port", "9001",
        "--served-model-name", "llama"])
    config = cli.engine_config_from_args(args)
    assert config == EngineConfig(
        model="/models/llama", max_num_batched_tokens=128, max_num_seqs=8,
        max_model_len=1024, block_size=32, kv_cache_memory_bytes=3 << 29,
        enable_prefix_caching=False, policy="priority", dtype="bfloat16",
        speculative_config=SpeculativeConfig("dflash", 2, draft_policy="fit"))
    assert (args.host, args.port, args.served_model_name) == ("127.0.0.1", 9001, "llama")
    defaults = cli.engine_config_from_args(cli._parser().parse_args(["serve"]))
    assert defaults == EngineConfig()  # vllm serve's defaults are EngineConfig's


@pytest.mark.parametrize(("text", "expected"), [
    ("4096", 4096), ("64K", 64 << 10), ("256M", 256 << 20), ("2G", 2 << 30),
    ("512MiB", 512 << 20), ("1.5g", 3 << 29)])
def test_parse_bytes(text: str, expected: int) -> None:
    assert cli.parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "0", "-1M"])
def test_parse_bytes_refuses(bad: str) -> None:
    with pytest.raises(Exception, match="size"):
        cli.parse_bytes(bad)


def test_serve_refuses_a_bad_speculative_config() -> None:
    args = cli._parser().parse_args(["serve", "--speculative-config", "{method: ngram}"])
    with pytest.raises(ValueError, match="not JSON"):
        cli.engine_config_from_args(args)


def _one_line_refusal(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert says in err, err


SPEC = "--speculative-config"


@pytest.mark.parametrize(("argv", "says"), [
    ([SPEC, '{"method": "bogus", "num_speculative_tokens": 2}'],
     "--speculative-config: SpeculativeConfig.method='bogus' is not supported"),
    ([SPEC, '{"method": "ngram", "num_speculative_tokens": 0}'], "must be >= 1"),
    ([SPEC, '{"method": "ngram", "num_speculative_tokens": -1}'], "must be >= 1"),
    ([SPEC, '{"method": "ngram", "num_speculative_tokens": 3.5}'], "must be an integer"),
    ([SPEC, '{"method": "ngram", "num_speculative_tokens": "3"}'], "must be an integer"),
    ([SPEC, '{"method": "ngram", "num_speculative_tokens": true}'], "must be an integer"),
    ([SPEC, '{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}'], "unknown keys"),
    ([SPEC, '{"method": "eagle", "num_speculative_tokens": 2, "min_draft_confidence": 1.5}'],
     "min_draft_confidence must be a number in [0, 1]"),
    ([SPEC, '{"method": "parallel", "num_speculative_tokens": 2, '
            '"min_draft_confidence": 0.2}'], "unknown keys ['min_draft_confidence']"),
    ([SPEC, '{"method": "eagle", "num_speculative_tokens": 4, "draft_top_k": 0, '
            '"draft_policy": "fixed"}'], "draft_top_k must be an integer in [1, 8]"),
    ([SPEC, '{"method": "ngram", "num_speculative_tokens": 2, "draft_top_k": 2}'],
     "unknown keys ['draft_top_k']"),
    (["--max-tokens", "0"], "--max-tokens must be"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--block-size", "0"], "--block-size must be an integer >= 1"),
])
def test_generate_refuses_user_errors_in_one_line(argv: list[str], says: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_refusal(["generate", *argv], says, capsys)


@pytest.mark.model
@pytest.mark.parametrize(("argv", "says"), [
    ([SPEC, '{"method": "ngram", "num_speculative_tokens": 1000}'], "max_num_batched_tokens"),
    ([SPEC, '{"method": "eagle", "num_speculative_tokens": 3}'], "train-drafter"),
    (["--prompt", ""], "prompt must be a non-empty string"),
    (["--kv-cache-memory", "100T"], "is more than this cpu device has"),
])
def test_generate_refuses_what_the_engine_refuses_in_one_line(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No trained head, whatever this machine's cache holds (a head trained here would
    # otherwise be served, and eagle not refused).
    from runner import drafter

    monkeypatch.setattr(drafter, "trained_head_dir", lambda _path, name: tmp_path / name)
    _one_line_refusal(["generate", *argv], says, capsys)


@pytest.mark.parametrize(("argv", "says"), [
    ([SPEC, '{"method": "ngram", "num_speculative_tokens": "3"}'], "must be an integer"),
    ([SPEC, "[1]"], "must be a JSON object"),
    (["--block-size", "0"], "--block-size must be an integer >= 1"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["--ray-address", "10.0.0.1:6379"], "--ray-address needs --data-parallel-size > 1"),
])
def test_serve_refuses_user_errors_in_one_line(argv: list[str], says: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_refusal(["serve", *argv], says, capsys)


@pytest.mark.model
def test_serve_refuses_a_kv_cache_larger_than_the_machine(
        capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_refusal(["serve", "--kv-cache-memory", "100T"],
                      "cannot start: kv_cache_memory_bytes=", capsys)


@pytest.mark.parametrize(("argv", "says"), [
    (["serve", "--port", "70000"], "port must be in [0, 65535]"),
    (["serve", "--kv-cache-memory", "infG"], "not a size"),
    (["generate", "--kv-cache-memory", "nanM"], "not a size"),
])
def test_option_values_argparse_refuses(argv: list[str], says: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.model
def test_serve_runs_uvicorn_on_an_app_with_metrics(monkeypatch: pytest.MonkeyPatch,
                                                   model: LlamaForCausalLM) -> None:
    """`serve` wires engine, app and metrics, then runs them in a DrainingServer."""
    from fastapi.testclient import TestClient

    from engine.local_server import DrainingServer

    seen: dict[str, Any] = {}
    monkeypatch.setattr("runner.model_runner.load_model", lambda *_: model)  # loaded once

    def fake_run(server: DrainingServer) -> None:
        seen.update(host=server.config.host, port=server.config.port,
                    timeout=server.shutdown_timeout)
        with TestClient(server.config.app) as client:
            seen["models"] = client.get("/v1/models").json()
            body = {"prompt": "1 2 3 4", "max_tokens": 3, "temperature": 0}
            seen["completion"] = client.post("/v1/completions", json=body).json()
            seen["metrics"] = client.get("/metrics").text

    monkeypatch.setattr(DrainingServer, "run", fake_run)
    assert cli.main(["serve", "--port", "8123", "--served-model-name", "tiny",
                     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                     "--max-num-batched-tokens", "64", "--kv-cache-memory", "16M",
                     "--max-model-len", "256", "--shutdown-timeout", "2.5"]) == 0
    assert seen["port"] == 8123 and seen["models"]["data"][0]["id"] == "tiny"
    assert seen["timeout"] == 2.5
    assert seen["completion"]["usage"]["completion_tokens"] == 3
    assert 'specbudget:generation_tokens_total{model_name="tiny"} 3.0' in seen["metrics"]
    assert 'specbudget:budget_pass_utilization{model_name="tiny",pass="target"}' in (
        seen["metrics"])


@pytest.mark.model
def test_bench_serve_writes_json_and_plot(tmp_path: Path, model: LlamaForCausalLM,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    config = EngineConfig(max_num_batched_tokens=128, max_num_seqs=4, max_model_len=256,
                          num_kv_blocks=64,
                          speculative_config=SpeculativeConfig("ngram", 3))
    engine = AsyncEngine(config, model=model)
    try:
        with serve_in_thread(engine, "smollm2-135m") as server:
            assert cli.main(["bench", "serve", "--base-url", server.base_url,
                             "--concurrency", "1,2", "--num-prompts", "2", "--max-tokens", "6",
                             "--ignore-eos",
                             "--out", str(tmp_path / "b.json"),
                             "--plot", str(tmp_path / "b.png")]) == 0
            metrics = httpx.get(f"{server.base_url}/metrics").text
            assert cli.main(["bench", "serve", "--base-url", server.base_url,
                             "--request-rate", "20,inf", "--num-prompts", "2",
                             "--max-tokens", "3", "--label", "poisson", "--endpoint", "chat",
                             "--max-concurrency", "1", "--out", str(tmp_path / "r.json")]) == 0
    finally:
        engine.shutdown()
    captured = capsys.readouterr()
    out = captured.out
    assert "concurrency 1: 2/2 ok" in out and "concurrency 2: 2/2 ok" in out
    # A rate run reports its rate and the cap, never a concurrency it did not use.
    assert "rate 20.0 req/s (at most 1 in flight): 2/2 ok" in out
    assert "requests: 100%" in captured.err  # the progress bar, as vLLM's
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["model"] == "smollm2-135m"  # read from /v1/models
    runs = report["series"]["smollm2-135m"]
    assert [r["concurrency"] for r in runs] == [1, 2]
    for run in runs:
        assert run["completed"] == 2 and run["failed"] == 0
        assert run["total_output_tokens"] == 12  # ignore_eos: max_tokens each
        assert run["ttft_ms"]["p50"] > 0 and run["e2e_ms"]["p99"] >= run["ttft_ms"]["p99"]
        assert run["output_throughput"] > 0
        spec = run["spec_decode"]
        assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0
        assert sum(spec["accepted_per_pos"]) == spec["num_accepted_tokens"]
    # The runs' spec-decode deltas add up to the server's totals (minus the warm-up).
    drafted = sum(r["spec_decode"]["num_draft_tokens"] for r in runs)
    total = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("specbudget:spec_decode_num_draft_tokens_total{"))
    assert drafted <= total
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rate_runs = json.loads((tmp_path / "r.json").read_text())["series"]["poisson"]
    assert [(r["request_rate"], r["concurrency"], r["max_concurrency"])
            for r in rate_runs] == [(20.0, None, 1), ("inf", None, 1)]
    assert all(r["completed"] == 2 and r["endpoint"] == "chat" for r in rate_runs)


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--concurrency", "0", "--concurrency values must be > 0"),
    ("--concurrency", "4,x", "comma-separated list"),
    ("--request-rate", "0", "--request-rate values must be > 0"),
    ("--num-prompts", "0", "--num-prompts must be >= 1"),
])
def test_bench_serve_refuses_bad_load(flag: str, value: str, says: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "serve", flag, value]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_bench_serve_refused_connection_is_one_line(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert cli.main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot reach http://127.0.0.1:{port}" in err


@pytest.mark.model
def test_serve_bench_script_self_contained(tmp_path: Path) -> None:
    """benchmarks/serve_bench.py: two `specbudget serve` processes in turn, spec off then
    ngram, the client in this process."""
    from benchmarks import serve_bench

    report = serve_bench.main(["--quick", "--concurrency", "2", "--num-prompts", "2",
                               "--max-tokens", "5", "--out", str(tmp_path / "s.json")])
    assert list(report["series"]) == ["spec off", "ngram K=3"]
    off, ngram = (runs[0] for runs in report["series"].values())
    assert off["completed"] == ngram["completed"] == 2
    # Greedy and lossless: the same tokens with speculation on as off.
    assert off["total_output_tokens"] == ngram["total_output_tokens"] > 0
    assert off["spec_decode"]["num_draft_tokens"] == 0
    assert ngram["spec_decode"]["num_draft_tokens"] > 0
    assert (tmp_path / "s.png").exists()




@pytest.mark.parametrize(("argv", "says"), [
    (["--num-speculative-tokens", "0"], "must be in [1, 16], got 0"),
    (["--num-speculative-tokens", "-3"], "must be in [1, 16], got -3"),
    (["--draft-vocab-size", "0"], "must be >= 1, got 0"),
    (["--tokens", "0"], "must be >= 1, got 0"),
    (["--updates", "-1"], "must be >= 1, got -1"),
    (["--max-prompts", "x"], "not an integer"),
    (["--lr", "0"], "must be a finite number > 0, got 0"),
    (["--lr", "nan"], "must be a finite number > 0, got nan"),
    (["--weight-decay", "-0.1"], "must be a finite number >= 0, got -0.1"),
    (["--head-layers", "0"], "must be >= 1, got 0"),
])
def test_train_drafter_refuses_bad_options_at_parse_time(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train-drafter", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_train_drafter_refuses_a_draft_vocabulary_larger_than_the_target(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from training import pipeline

    def no_data(args: object) -> dict:
        raise AssertionError("the data phase started")

    monkeypatch.setattr(pipeline, "run", no_data)
    _one_line_refusal(["train-drafter", "--draft-vocab-size", "10000000"],
                      "--draft-vocab-size must be at most the target's vocabulary (49152), "
                      "got 10000000", capsys)
    # From the target, a head's layers are the target's from layer 27 on: 3 at most.
    _one_line_refusal(["train-drafter", "--head-layers", "4"],
                      "--head-layers must be at most 3 for a head that starts as the "
                      "target's layers from 27 (of 30; or --init random), got 4", capsys)
