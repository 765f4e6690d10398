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


def fed_stalled_steps(outlier_ratio: float) -> StepTimeModel:
    """A lookup method's steps on an affine clock, every 25th of them (from the 13th,
    after calm ones) stalled for two seconds (a kernel compiled on its first shape, the
    host preempting the process)."""
    model = StepTimeModel("lookup", GoodputSettings(outlier_ratio=outlier_ratio))
    rng = np.random.default_rng(0)
    for i in range(200):
        rows = int(rng.integers(1, 40))
        model.observe(rows, rows, 0, 0, 0.012 + 0.0002 * rows + (2.0 if i % 25 == 12 else 0.0))
    return model


def test_a_stalled_step_is_not_a_price() -> None:
    model = fed_stalled_steps(GoodputSettings().outlier_ratio)
    assert model.num_stalls == 8
    # Each stall still counts as 4x its price: a few % over the truth here, not 3x.
    assert float(model.predict(16, 16, 0, 0)) == pytest.approx(0.012 + 0.0002 * 16, rel=0.2)


def test_without_the_cap_the_stalls_set_the_price() -> None:
    """The check above is real: fitted as measured, eight stalls in 200 steps price
    every step several times what it takes."""
    model = fed_stalled_steps(float("inf"))
    assert model.num_stalls == 0
    assert float(model.predict(16, 16, 0, 0)) > 3 * (0.012 + 0.0002 * 16)


def test_a_machine_far_slower_than_the_prior_is_fitted_at_once() -> None:
    """Every step 30x what the prior prices (a larger model on a CPU): no calm steps
    came first, so none is taken for a stall, and the fit has the price in a few steps."""
    model = StepTimeModel("lookup", GoodputSettings())
    prior = float(model.predict(8, 8, 0, 0))
    for _ in range(4):
        model.observe(8, 8, 0, 0, 30 * prior)
    assert model.num_stalls == 0
    assert float(model.predict(8, 8, 0, 0)) == pytest.approx(30 * prior, rel=0.05)


def test_after_calm_steps_a_jump_is_capped_once_then_fitted() -> None:
    """Steps at their price, then the clock jumps 10x for good (a slow region the fit
    never saw): the first step of the jump is capped, the ones after it are not, so the
    fit follows the jump almost as if nothing were capped."""
    capped, uncapped = (StepTimeModel("lookup", GoodputSettings(outlier_ratio=ratio))
                        for ratio in (4.0, float("inf")))
    for model in (capped, uncapped):
        for seconds in [0.02] * 40 + [0.2] * 12:
            model.observe(8, 8, 0, 0, seconds)
    assert capped.num_stalls == 1
    assert float(capped.predict(8, 8, 0, 0)) == pytest.approx(
        float(uncapped.predict(8, 8, 0, 0)), rel=0.1)


def catch_up_after_one_chunk(monkeypatch: pytest.MonkeyPatch | None = None) -> float:
    """A fresh head's price of catching up 218 parked rows in one pass, after one step
    as a fresh engine's first runs it (a 256-row prefill whose last chunk's 38 rows
    also ran the head, in 4 ms where the prior says 5.4), as a share of the prior's."""
    model = StepTimeModel("head", GoodputSettings())
    before = float(model.predict(6, 6, 218, 1) - model.predict(6, 6, 0, 0))
    model.observe(256, 5, 38, 1, 0.19, drafter_seconds=0.004)
    return float(model.predict(6, 6, 218, 1) - model.predict(6, 6, 0, 0)) / before


def test_one_short_drafter_pass_does_not_make_catching_up_cheap() -> None:
    """A head's price per row has a step's weight behind it: one pass a quarter under
    its price takes under a fifth off the price of a 218-row catch-up, not half
    (measured: eagle at 16 running then drafted for the whole batch and lost)."""
    assert 0.75 < catch_up_after_one_chunk() < 1.0


def test_with_a_row_weighing_as_a_base_slope_the_catch_up_halves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above is real: with a head's row weighing what a target's slope does
    (a hundredth of a step, as before), the same one step prices the catch-up at
    about half the prior's."""
    import scheduler.step_cost as step_cost
    monkeypatch.setattr(step_cost, "_PRIOR_STEPS_HEAD_ROW", step_cost._PRIOR_STEPS_BASE)
    assert catch_up_after_one_chunk() < 0.7
