"""The `specbudget simulate` and `prepare-model` commands."""

from __future__ import annotations

import json

import pytest

from specbudget.cli import main


def test_simulate_prints_a_budget_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--method", "dflash", "--num-decoders", "8", "--num-long", "1",
                 "--max-num-batched-tokens", "128", "--rows", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["step", "run", "wait", "target/B", "context/B", "query/B"]
    assert lines[0].split()[6:8] == ["k-sum", "k-max"]
    assert [ln.split()[0] for ln in lines[1:6]] == ["0", "1", "2", "3", "4"]
    assert not lines[6].strip()  # --rows 5: five steps, then the summary
    assert "no pass ever exceeded B" in lines[-2]
    # The goodput policy (the default) says what it chose.
    assert lines[-1].startswith("chosen k (draft_policy=goodput): requests per k {0: ")


def test_simulate_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--method", "pard", "--json", "--num-decoders", "8",
                 "--num-long", "1", "--max-num-batched-tokens", "64"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["method"] == "pard"
    assert all(rows <= 64 for rows in summary["peak_rows_per_pass"].values())
    assert summary["steps"] > 0 and 0.0 <= summary["acceptance_rate"] <= 1.0
    chosen = summary["goodput"]["chosen_k"]  # the default policy's choices, k = 0 .. K
    assert summary["draft_policy"] == "goodput" and sum(chosen) > 0 and len(chosen) <= 5


def test_prepare_model_prints_a_loadable_dir(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    assert main(["prepare-model"]) == 0
    path = Path(capsys.readouterr().out.strip())
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and (path / "tokenizer.json").exists()


def test_simulate_takes_a_gpus_clock_and_prior(capsys: pytest.CaptureFixture[str]) -> None:
    """A drafter pass priced apart from the target's, and the GPU's step-time prior:
    both reach the run (the prior changes what goodput chooses on the same clock)."""
    gpu_clock = ["simulate", "--method", "eagle", "--json", "--num-decoders", "24",
                 "--num-long", "0", "--max-num-seqs", "16", "--seconds-per-pass", "0.012",
                 "--seconds-per-row", "0.000005", "--seconds-per-drafter-pass", "0.0013",
                 "--acceptance", "0.42"]
    chosen = {}
    for prior in ("cpu", "gpu"):
        assert main([*gpu_clock, "--step-prior", prior]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["step_prior"] == prior
        chosen[prior] = summary["goodput"]["chosen_k"]
    assert chosen["cpu"] != chosen["gpu"]
    with pytest.raises(SystemExit):
        main([*gpu_clock, "--step-prior", "tpu"])


@pytest.mark.parametrize("option, value, message", [
    ("--seconds-per-drafter-pass", "-1", "--seconds-per-drafter-pass must be >= 0 seconds"),
    ("--seconds-per-row", "nan", "--seconds-per-row must be >= 0 seconds"),
    ("--acceptance", "1.5", "--acceptance must be a probability in [0, 1]"),
    ("--max-num-batched-tokens", "0", "--max-num-batched-tokens must be >= 1"),
    ("--num-speculative-tokens", "0", "num_speculative_tokens"),
])
def test_simulate_refuses_what_no_run_could_mean(option: str, value: str, message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """One line naming the option, exit code 2, no traceback and no table."""
    assert main(["simulate", "--method", "eagle", "--num-decoders", "4", "--num-long", "0",
                 option, value]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("specbudget simulate: ") and message in captured.err
    assert "Traceback" not in captured.err
