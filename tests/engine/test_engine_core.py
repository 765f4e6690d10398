"""What the engine core hands the scheduler from its runner (the KV size and a trained
head's measured acceptance are checked where they are used: tests/runner)."""

from __future__ import annotations

import torch

from engine.core import step_prior_for


def test_an_engine_picks_the_step_prior_by_its_device() -> None:
    """GoodputSettings.step_prior: the CPU's prior, or a GPU's for any accelerator."""
    assert step_prior_for(torch.device("cpu")) == "cpu"
    assert step_prior_for(torch.device("cuda", 0)) == "gpu"
    assert step_prior_for(torch.device("mps")) == "gpu"
