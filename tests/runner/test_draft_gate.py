"""The confidence gate of chain drafters (runner/draft_gate.py): a request's chain
stops once the product of its drafts' probabilities falls below the threshold, the
threshold is checked where it is given, a trained head serves with the measured
default and a random one draws every chain to its k, and the gate skips the drafter's
passes without changing a single output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.draft_gate import (
    TRAINED_HEAD_MIN_CONFIDENCE,
    TRAINED_HEAD_TREE_MIN_CONFIDENCE,
    ConfidenceGate,
    min_draft_confidence,
)
from spec_decode import SpeculativeConfig
from spec_decode.sampling import greedy_ids, greedy_with_confidence


class ScriptedNet:
    """Drafts row i as token i; each call's probabilities come from a script."""

    def __init__(self, probs: list[list[float]]) -> None:
        self.probs = probs
        self.greedy_calls = 0

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        self.greedy_calls += 1
        return torch.arange(len(hidden))

    def drafts_with_confidence(self, hidden: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.arange(len(hidden)), torch.tensor(self.probs.pop(0))


def test_a_chain_stops_on_the_product_of_its_drafts_probabilities() -> None:
    net = ScriptedNet([[0.9, 0.2, 0.6], [0.5, 0.9]])
    gate = ConfidenceGate(0.5)
    hidden = torch.zeros(3, 4)
    assert gate.drafts(net, hidden, [0, 1, 2]) == [[0], [1], [2]]
    assert gate.still_drafting(np.array([0, 1, 2])).tolist() == [0, 2]
    gate.drafts(net, hidden[:2], [0, 2])
    # 0.9 * 0.5 = 0.45 stops request 0; a gate reading each draft alone (0.5 >= 0.5)
    # would let it go on.
    assert gate.still_drafting(np.array([0, 2])).tolist() == [2]
    assert gate.still_drafting(np.array([], dtype=np.int64)).tolist() == []


def test_a_zero_threshold_computes_no_probability() -> None:
    net = ScriptedNet([])
    gate = ConfidenceGate(0.0)
    assert gate.drafts(net, torch.zeros(2, 4), [3, 5]) == [[0], [1]]
    assert net.greedy_calls == 1
    assert gate.still_drafting(np.array([3, 5])).tolist() == [3, 5]


def test_greedy_with_confidence_is_the_greedy_pick_and_its_softmax_probability() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1.0  # a tie: the first index
    for dtype in (torch.float32, torch.bfloat16):
        ids, probs = greedy_with_confidence(logits.to(dtype))
        assert torch.equal(ids, greedy_ids(logits.to(dtype)))
        want = torch.softmax(logits.to(dtype).float(), dim=-1).max(dim=-1).values
        assert probs.dtype == torch.float32
        torch.testing.assert_close(probs, want)
    assert int(greedy_with_confidence(logits)[0][2]) == 7


def test_the_default_threshold() -> None:
    assert min_draft_confidence({}, sequential=True, trained=True) == \
        TRAINED_HEAD_MIN_CONFIDENCE > 0
    assert min_draft_confidence({}, sequential=True, trained=False) == 0.0
    # A trained head drafting trees: its own default, lower than a chain's.
    assert 0 < min_draft_confidence({}, True, True, tree=True) == \
        TRAINED_HEAD_TREE_MIN_CONFIDENCE < TRAINED_HEAD_MIN_CONFIDENCE
    assert min_draft_confidence({}, True, False, tree=True) == 0.0
    assert min_draft_confidence({"min_draft_confidence": 0.4}, True, True, tree=True) == 0.4
    assert min_draft_confidence({"min_draft_confidence": 0.0}, True, True) == 0.0
    assert min_draft_confidence({"min_draft_confidence": 0.4}, True, False) == 0.4
    # A method that drafts all its k in one pass has no chain to stop.
    assert min_draft_confidence({"min_draft_confidence": 0.4}, False, True) == 0.0


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, math.inf, "0.3", True, None, [0.2]])
def test_a_bad_threshold_is_refused_by_name(value: object) -> None:
    spec = {"method": "eagle", "num_speculative_tokens": 3, "min_draft_confidence": value}
    if value is None:  # JSON null: not given, the default
        assert SpeculativeConfig.from_dict(spec) is not None
        return
    with pytest.raises(ValueError, match=r"min_draft_confidence must be a number in \[0, 1\]"):
        SpeculativeConfig.from_dict(spec)


def test_every_entry_point_refuses_a_bad_threshold_by_name() -> None:
    """The offline `LLM` (before any model loads) and `specbudget serve`'s config, as
    `SpeculativeConfig.from_dict` (the generate command: tests/specbudget/test_cli.py)."""
    from engine.llm import LLM
    from specbudget import cli

    bad = {"method": "eagle", "num_speculative_tokens": 2, "min_draft_confidence": 2}
    with pytest.raises(ValueError, match=r"min_draft_confidence must be a number in \[0, 1\]"):
        LLM(speculative_config=bad)
    args = cli._parser().parse_args(["serve", "--speculative-config", json.dumps(bad)])
    with pytest.raises(ValueError, match=r"min_draft_confidence must be a number in \[0, 1\]"):
        cli.engine_config_from_args(args)


def test_only_chain_methods_take_a_threshold() -> None:
    for method in ("eagle", "mtp", "draft_model"):
        assert SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 2,
                                            "min_draft_confidence": 1}) is not None
    for method in ("parallel", "dflash", "ngram"):
        with pytest.raises(ValueError, match="unknown keys"):
            SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 2,
                                         "min_draft_confidence": 0.2})


@pytest.mark.model
def test_the_gate_skips_passes_and_changes_no_output(tmp_path: Path) -> None:
    """A random head is never confident (about 1 / 8192 a draft): at threshold 0 its
    chains run to K, at 0.5 each stops after its first draft, the drafter running one
    pass a step instead of K, and every output stays speculation off's. A head loaded
    from a directory serves with the trained default; "random" with none."""
    from engine.llm import LLM
    from scheduler import SamplingParams
    from tests.runner.test_eagle3 import write_published_layout
    from tests.server_helpers import default_model

    model = default_model()
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)

    def served(spec: dict | None) -> tuple[list[list[int]], dict, int, LLM]:
        llm = LLM(loaded_model=model, num_kv_blocks=32, max_model_len=128,
                  speculative_config=spec)
        calls = 0
        if spec is not None:
            head = llm.engine.runner.spec.drafter.net
            real = head.forward

            def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
                nonlocal calls
                calls += 1
                return real(*args, **kwargs)

            head.forward = counted
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        return outs, llm.get_metrics()["spec_decode"], calls, llm

    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": "random",
            "draft_policy": "fixed"}
    off, *_ = served(None)
    full, full_stats, full_calls, llm = served({**spec, "min_draft_confidence": 0.0})
    assert llm.engine.runner.spec.drafter.min_confidence == 0.0
    gated, gated_stats, gated_calls, _ = served({**spec, "min_draft_confidence": 0.5})
    assert full == off and gated == off
    drafted = gated_stats["num_draft_tokens_per_pos"]
    assert drafted[0] > 0 and sum(drafted[1:]) == 0
    assert sum(full_stats["num_draft_tokens_per_pos"][1:]) > 0
    assert gated_calls < full_calls
    _, _, _, default = served(spec)
    assert default.engine.runner.spec.drafter.min_confidence == 0.0  # random: none
    write_published_layout(tmp_path / "head", model, [2, 15, 27])
    _, _, _, trained = served({**spec, "model": str(tmp_path / "head")})
    assert trained.engine.runner.spec.drafter.min_confidence == TRAINED_HEAD_MIN_CONFIDENCE
    _, _, _, tree = served({**spec, "model": str(tmp_path / "head"),
                            "num_speculative_tokens": 5, "draft_top_k": [2, 1]})
    assert tree.engine.runner.spec.drafter.min_confidence == TRAINED_HEAD_TREE_MIN_CONFIDENCE


@pytest.mark.parametrize("value", [0, 9, -1, 2.0, "2", True, [], [2, 0], [9], [True],
                                   [2] * 17, {"depth": 2}])
def test_a_bad_tree_width_is_refused_by_name(value: object) -> None:
    spec = {"method": "eagle", "num_speculative_tokens": 4, "draft_top_k": value,
            "draft_policy": "fixed"}
    with pytest.raises(ValueError, match=r"draft_top_k must be an integer in \[1, 8\]"):
        SpeculativeConfig.from_dict(spec)


def test_widths_per_depth_are_taken() -> None:
    spec = SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 8,
                                        "draft_top_k": [4, 2], "draft_policy": "fixed"})
    assert spec is not None
    assert spec.tree_shape.widths == (4, 2) and spec.spec_method.depth(8) == 3


def test_every_entry_point_refuses_a_bad_tree_by_name() -> None:
    """The offline `LLM` (before any model loads) and `specbudget serve`'s config."""
    from engine.llm import LLM
    from specbudget import cli

    bad = {"method": "eagle", "num_speculative_tokens": 4, "draft_top_k": [4, 0]}
    says = r"draft_top_k must be an integer in \[1, 8\]"
    with pytest.raises(ValueError, match=says):
        LLM(speculative_config=bad)
    args = cli._parser().parse_args(["serve", "--speculative-config", json.dumps(bad)])
    with pytest.raises(ValueError, match=says):
        cli.engine_config_from_args(args)
    for policy in ("goodput", "fixed", "fit"):
        assert SpeculativeConfig.from_dict({**bad, "draft_top_k": [4, 2],
                                            "draft_policy": policy}) is not None
