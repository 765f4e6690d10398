"""A speculative method is one class, end to end: registering it (and nothing else)
reaches the training command's choices and layout, the trained-head lookup and the
runner's drafter table; a drafter kind the runner does not know is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

import runner.drafter as drafter
from engine.llm import LLM
from runner.drafters import (
    DRAFTER_FACTORIES,
    DraftContext,
    TokenDrafter,
    drafter_factory,
    make_drafter,
)
from scheduler import SamplingParams
from spec_decode import SpeculativeConfig
from spec_decode.methods import SpecMethod, TrainLayout, get_method, method_names, registered
from spec_decode.proposer import TokenProposer
from specbudget import cli
from tests.server_helpers import default_model
from training.layouts import train_layout
from training.options import trainable_methods

# No runner part is touched before a factory runs: the tests' factories ignore it.
NO_CONTEXT = cast(DraftContext, None)


class ToyHeadMethod(SpecMethod):
    """A head method defined outside the package, trainable in its own layout and
    serving with eagle's head when none was trained for it."""

    name = "toy_head"
    drafter = "head"
    train_layout = TrainLayout(token_shift=1, later="mask", bonus=True, label_offset=0)
    shares_head_with = "eagle"


class ToyKindMethod(SpecMethod):
    name = "toy_kind"
    drafter = "toy-drafter"


def test_a_registered_head_method_reaches_the_training_command() -> None:
    assert ToyHeadMethod.name not in trainable_methods()
    with registered(ToyHeadMethod):
        assert ToyHeadMethod.name in trainable_methods()
        args = cli._parser().parse_args(["train-drafter", "--method", ToyHeadMethod.name])
        assert args.method == ToyHeadMethod.name
        assert train_layout(ToyHeadMethod.name) is ToyHeadMethod.train_layout
    with pytest.raises(SystemExit):  # gone with the block: argparse refuses it
        cli._parser().parse_args(["train-drafter", "--method", ToyHeadMethod.name])


def test_training_choices_are_the_methods_with_a_layout() -> None:
    assert set(trainable_methods()) == {"eagle", "mtp", "parallel", "dflash"}
    with pytest.raises(ValueError, match="'ngram' has no head to train"):
        train_layout("ngram")


def test_a_shared_head_is_found_after_the_methods_own(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """mtp serves with eagle's trained head, and so does any method that says so."""
    monkeypatch.setattr(drafter, "trained_head_dir", lambda _path, name: tmp_path / name)

    def train(name: str) -> None:
        (tmp_path / name).mkdir()
        for file in ("config.json", "model.safetensors"):
            (tmp_path / name / file).touch()

    with registered(ToyHeadMethod):
        assert drafter.find_trained_head(tmp_path, ToyHeadMethod.name) is None
        train("eagle")
        for method in ("mtp", ToyHeadMethod.name):
            assert drafter.find_trained_head(tmp_path, method) == tmp_path / "eagle"
        train(ToyHeadMethod.name)
        assert drafter.find_trained_head(tmp_path, ToyHeadMethod.name) == \
            tmp_path / ToyHeadMethod.name
    assert drafter.find_trained_head(tmp_path, "parallel") is None  # shares with none


def test_every_registered_method_has_a_drafter_factory() -> None:
    for name in method_names():
        method = get_method(name)
        assert drafter_factory(method) is DRAFTER_FACTORIES[method.drafter], name


def test_a_registered_method_reaches_its_kinds_factory(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    made: list[tuple[str, Any]] = []

    def factory(spec: SpeculativeConfig, ctx: DraftContext) -> Any:
        made.append((spec.method, ctx))
        return "the toy drafter"

    monkeypatch.setitem(DRAFTER_FACTORIES, "toy-drafter", factory)
    with registered(ToyKindMethod):
        assert make_drafter(SpeculativeConfig(ToyKindMethod.name, 2), NO_CONTEXT) == \
            "the toy drafter"
    assert made == [(ToyKindMethod.name, NO_CONTEXT)]
    with registered(ToyHeadMethod):
        assert drafter_factory(get_method(ToyHeadMethod.name)) is DRAFTER_FACTORIES["head"]


def test_a_drafter_kind_without_a_factory_is_refused_by_name() -> None:
    with registered(ToyKindMethod), pytest.raises(
            ValueError, match=r"speculative method 'toy_kind' names drafter kind "
                              r"'toy-drafter', which has no factory in runner/drafters\.py"):
        make_drafter(SpeculativeConfig(ToyKindMethod.name, 2), NO_CONTEXT)


class RepeatLast(TokenProposer):
    """Proposes the last known token k times, and counts its calls."""

    calls = 0

    def propose(self, req_id: str, token_ids: np.ndarray, k: int) -> list[int]:
        RepeatLast.calls += 1
        return [int(token_ids[-1])] * k


class RepeatMethod(SpecMethod):
    name = "repeat_last"

    def make_proposer(self, config: Any) -> TokenProposer:
        return RepeatLast()


@pytest.mark.model
def test_a_new_lookup_method_serves_through_the_token_drafter() -> None:
    """The real runner drafts for a method registered outside the package, losslessly."""
    params = SamplingParams(max_tokens=12)
    prompt = ["one one one one"]
    off = LLM(loaded_model=default_model(), num_kv_blocks=16, max_model_len=128)
    expected = off.generate(prompt, params)[0].outputs[0].token_ids
    with registered(RepeatMethod):
        llm = LLM(loaded_model=default_model(), num_kv_blocks=16, max_model_len=128,
                  speculative_config={"method": RepeatMethod.name,
                                      "num_speculative_tokens": 2})
        spec = llm.engine.runner.spec
        assert spec is not None and isinstance(spec.drafter, TokenDrafter)
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == expected
    assert RepeatLast.calls > 0
