"""The goodput policy's step-time model fed the drafter's time apart from the step's."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler.config import GoodputSettings
from scheduler.step_cost import StepTimeModel

PASS, DRAFTER_ROW = 0.003, 0.0001  # the clock's drafter: per forward pass, per row


def fed_collinear_steps(timed_apart: bool, seed: int = 0) -> StepTimeModel:
    """A head's model fed steps as a small batch runs them: every request that samples
    drafts alike or none does, so verification rows, drafter rows and the drafter's
    passes rise together (the runner's real steps at 4 running). The target's clock
    also charges per request, which the model has no feature for."""
    model = StepTimeModel("head", GoodputSettings())
    rng = np.random.default_rng(seed)
    for i in range(300):
        requests = int(rng.integers(1, 9))
        k = int(rng.integers(1, 3)) if i % 2 else 0
        logits = requests * (1 + k)
        passes, drafter = (2, logits) if k else (0, 0)
        target_seconds = 0.02 + 0.0008 * logits + 0.001 * requests
        drafter_seconds = PASS * passes + DRAFTER_ROW * drafter
        model.observe(logits, logits, drafter, passes,
                      target_seconds + drafter_seconds + float(rng.normal(0, 0.001)),
                      drafter_seconds=drafter_seconds if timed_apart else None)
    return model


def drafting_cost(model: StepTimeModel) -> float:
    """What the model says the drafter adds to a step of 4 requests: its two passes
    over 4 rows, the target's rows held."""
    return float(model.predict(4, 4, 4, 2) - model.predict(4, 4, 0, 0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_drafter_timed_apart_is_priced_by_its_own_time(seed: int) -> None:
    truth = 2 * PASS + 4 * DRAFTER_ROW
    assert drafting_cost(fed_collinear_steps(True, seed)) == pytest.approx(truth, rel=0.05)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_from_whole_steps_alone_the_same_data_misprice_the_drafter(seed: int) -> None:
    """The check above is real: without the drafter's time the fit splits the same
    steps' time between verification rows and drafter passes as its prior leans,
    and the drafter's price is off by a third."""
    truth = 2 * PASS + 4 * DRAFTER_ROW
    assert abs(drafting_cost(fed_collinear_steps(False, seed)) / truth - 1.0) > 0.2


def test_steps_without_a_drafter_pass_are_fitted_whole() -> None:
    """A drafter time on a step that ran no drafter pass (a lookup method's lookup, a
    batch that parked) is not split off: the target's features pay for it, as before."""
    whole, timed = (StepTimeModel("lookup", GoodputSettings()) for _ in range(2))
    for rows in range(1, 40):
        whole.observe(rows, rows, 0, 0, 0.02 + 0.001 * rows)
        timed.observe(rows, rows, 0, 0, 0.02 + 0.001 * rows, drafter_seconds=0.0005)
    np.testing.assert_allclose(timed.theta, whole.theta)
