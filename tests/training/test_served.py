"""The served figure's order: the fixed-K runs first, their acceptance recorded where an
engine that loads the head reads it, then the default policy (no model: the rounds are
faked, each seeing what a head loaded then would start from)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import training.served as served
from runner.eagle3 import measured_acceptance


def fake_rounds(head_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Each round returns off (10 tok/s) and its configurations: 14 tok/s, 15 for one
    with the trained head's default confidence gate (no `min_draft_confidence` given)
    after one with the gate off, 16 for trees (30 verifications, 12 won by a leaf);
    the policy of the first configuration and the prior a head loaded then would have,
    per round."""
    seen: list[tuple[str, Any]] = []

    def one_round(model: object, specs: list[dict[str, Any] | None], prompts: list[str],
                  max_tokens: int) -> list[dict[str, Any]]:
        assert specs[0] is None and specs[1] is not None
        seen.append((specs[1]["draft_policy"], measured_acceptance(head_dir)))
        off = {"tokens_per_s": 10.0, "outputs": [[1, 2]], "drafted": [], "accepted": [],
               "drafts": 0, "leaf_hits": 0}
        on = {"tokens_per_s": 14.0, "outputs": [[1, 2]], "drafted": [40, 20],
              "accepted": [20, 5], "drafts": 40, "leaf_hits": 0}
        gated = {**on, "tokens_per_s": 15.0, "drafted": [40, 10]}
        tree = {**on, "tokens_per_s": 16.0, "drafted": [30, 30, 10], "accepted": [21, 6, 0],
                "drafts": 30, "leaf_hits": 12}

        def run(spec: dict[str, Any]) -> dict[str, Any]:
            if "draft_top_k" in spec:
                return tree
            chain_gated = "min_draft_confidence" not in spec and spec["draft_policy"] == "fixed"
            return gated if chain_gated and len(specs) == 3 else on
        return [off, *(run(spec) for spec in specs[1:] if spec is not None)]

    monkeypatch.setattr(served, "side_by_side", one_round)
    return seen


def test_the_default_policy_runs_with_the_served_acceptance_as_its_prior(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "metrics.json").write_text(json.dumps({"method": "dflash"}))
    seen = fake_rounds(tmp_path, monkeypatch)
    got = served.served_figures(None, tmp_path, "dflash", 2, num_prompts=2, rounds=2)  # type: ignore[arg-type]
    assert [policy for policy, _ in seen] == ["fixed", "fixed", "goodput", "goodput"]
    assert seen[0][1] is None and seen[1][1] is None  # no record yet, no config either
    prior = seen[2][1]
    assert prior is not None and prior.rates == pytest.approx((0.5, 0.5))  # 0.25 / 0.5
    assert prior.verifications == 2 * 60 // (2 * 2)  # draft tokens / (K x rounds)
    assert got["acceptance_per_position"] == [0.5, 0.25]
    assert got["speedup_vs_off"] == got["speedup_vs_off_default_policy"] == 1.4
    assert got["lossless"]
    kept = json.loads((tmp_path / "metrics.json").read_text())
    assert kept["method"] == "dflash"  # the rest of the file is kept
    assert kept["served"]["acceptance_per_position"] == [0.5, 0.25]


def test_a_chain_method_measures_acceptance_with_every_chain_drawn_to_k(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eagle's fixed runs: its acceptance from the run with the confidence gate off (the
    head's own figure, and the prior its goodput policy reads, which counts every
    verification as drafting K), its tok/s as the engine serves it, gate on."""
    seen = fake_rounds(tmp_path, monkeypatch)
    got = served.served_figures(None, tmp_path, "eagle", 2, num_prompts=2)  # type: ignore[arg-type]
    assert [policy for policy, _ in seen] == ["fixed", "goodput"]
    assert got["acceptance_per_position"] == [0.5, 0.25]  # not the gated run's 0.5, 0.5
    assert got["speedup_vs_off"] == 1.5 and got["speedup_vs_off_every_chain_to_k"] == 1.4
    assert got["min_draft_confidence"] > 0
    # Half the gated chains reached their second draft, where all the whole ones did.
    assert got["proposal_rates"] == [1.0, 0.5]
    kept = json.loads((tmp_path / "metrics.json").read_text())["served"]
    assert kept["proposal_rates"] == [1.0, 0.5]  # recorded before the default policy ran
    # ... with the gate they were measured at, which the default policy's engine serves
    # with: the prior it read had them.
    assert kept["min_draft_confidence"] == got["min_draft_confidence"]
    assert seen[1][1] is not None and seen[1][1].proposal_rates == (1.0, 0.5)
    assert seen[1][1].gate == got["min_draft_confidence"]
    assert got["speedup_vs_off_default_policy"] == 1.4
    # Beside the default policy, trees of SERVED_TREE K deep, their K the nodes (2 deep).
    assert got["tree"] == {"draft_top_k": [6, 3, 1], "k": 6 + 3, "mean_acceptance_length": 1.9,
                           "reach": [0.7, 0.2], "leaf_hits": 12,
                           "verifications": 30, "speedup_vs_off": 1.6}


def test_requests_take_turns_only_one_at_a_time() -> None:
    """Taking turns a whole request at a time has no meaning with several running."""
    with pytest.raises(ValueError, match="one request at a time"):
        served.side_by_side(None, [None], ["p"], 4, by_request=True, concurrency=2)  # type: ignore[arg-type]
