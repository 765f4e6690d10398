"""A goodput choice that drafts is kept for the next steps, looked up by each request's
state (scheduler/kept_choice.py): the same caps a new decision would give where the
estimates have not moved, and a new decision where the batch or its drafts changed."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.goodput import GoodputPolicy
from scheduler.request import ALL_ACCEPTED, NONE_ACCEPTED, NUM_OUTCOMES
from tests.scheduler.test_goodput import K, history, policy


def runs_policy(reuse_steps: int) -> GoodputPolicy:
    """A policy whose drafts come in runs: after a verification that accepted all, the
    next drafts are accepted 0.9 of the time; after one that accepted none, 0.1."""
    gp = policy("ngram", 0.02, 0.0008, acceptance=0.5, reuse_steps=reuse_steps)
    rng = np.random.default_rng(2)
    for state, rate in ((ALL_ACCEPTED, 0.9), (NONE_ACCEPTED, 0.1)):
        accepted = np.minimum(rng.geometric(1 - rate, 400) - 1, K)
        gp.acceptance.record([K] * 400, accepted.tolist(), [state] * 400)
    return gp


def decisions(gp: GoodputPolicy, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the decisions `gp` makes (each reads the estimates' rates)."""
    made = [0]
    read = gp.acceptance.rates_and_optimism

    def counted(*args: object, **kwargs: object) -> tuple[np.ndarray, np.ndarray]:
        made[0] += 1
        return read(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gp.acceptance, "rates_and_optimism", counted)
    return made


def step(gp: GoodputPolicy, verifications: np.ndarray, states: list[int],
         produced: list[int]) -> list[int]:
    first = verifications.sum(axis=1) // 2
    return gp.caps(verifications, first, np.array(states), np.full(len(states), K),
                   produced=np.array(produced)).tolist()


def verified(verifications: np.ndarray, rows: list[int], state: int) -> np.ndarray:
    got = verifications.copy()
    got[rows, state] += 1
    return got


def test_a_kept_choice_follows_each_requests_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests in a run of accepted drafts draft all K. Next step one of them
    verified and rejected everything: without a new decision it drafts what a new
    decision gives it (none), the other all K again."""
    kept, fresh = runs_policy(reuse_steps=4), runs_policy(reuse_steps=1)
    made = decisions(kept, monkeypatch)
    start = history([50, 50])
    assert step(kept, start, [ALL_ACCEPTED] * 2, [40, 40]) == [K, K]
    assert step(fresh, start, [ALL_ACCEPTED] * 2, [40, 40]) == [K, K]
    assert made[0] == 2  # the decision, and each request's caps per state
    now = verified(start, [0, 1], ALL_ACCEPTED)
    states = [NONE_ACCEPTED, ALL_ACCEPTED]
    got = step(kept, now, states, [41, 45])
    assert got == step(fresh, now, states, [41, 45]) == [0, K]
    assert made[0] == 2  # looked up, not decided


def test_a_kept_choice_lasts_its_steps_and_no_longer(monkeypatch: pytest.MonkeyPatch) -> None:
    """`reuse_steps` steps in all, the decision's included: then a new decision."""
    gp = runs_policy(reuse_steps=3)
    made = decisions(gp, monkeypatch)
    verifications, produced = history([50, 50]), [40, 40]
    for i in range(7):
        assert step(gp, verifications, [ALL_ACCEPTED] * 2, produced) == [K, K]
        verifications = verified(verifications, [0, 1], ALL_ACCEPTED)
        produced = [p + K + 1 for p in produced]
        assert made[0] == 2 * (i // 3 + 1)


@pytest.mark.parametrize("change", ["joined", "replaced", "drafts fell"])
def test_a_kept_choice_is_dropped_where_the_batch_changed(
        change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request joined, one was replaced by another (its output could not have
    shrunk), or the drafts fell to under half the decision's (a drafter pass paid for
    many may not pay for few): the next step decides again."""
    gp = runs_policy(reuse_steps=4)
    made = decisions(gp, monkeypatch)
    start = history([50, 50])
    assert step(gp, start, [ALL_ACCEPTED] * 2, [40, 40]) == [K, K]
    now = verified(start, [0, 1], ALL_ACCEPTED)
    if change == "joined":
        step(gp, np.vstack([now, np.zeros((1, NUM_OUTCOMES), dtype=np.int64)]),
             [ALL_ACCEPTED, ALL_ACCEPTED, 0], [45, 45, 0])
    elif change == "replaced":
        step(gp, now, [ALL_ACCEPTED] * 2, [45, 3])
    else:
        step(gp, now, [NONE_ACCEPTED] * 2, [41, 41])  # the kept caps: none
    assert made[0] > 2  # decided again


def test_nothing_is_kept_while_the_time_model_is_young(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over its first steps the time model moves most (the first drafting steps may show
    rows to be nearly free), so each step decides."""
    gp = runs_policy(reuse_steps=4)
    gp.time_model.num_observed = 0  # as if it had seen no step
    made = decisions(gp, monkeypatch)
    verifications, produced = history([50, 50]), [40, 40]
    for _ in range(3):
        step(gp, verifications, [ALL_ACCEPTED] * 2, produced)
        verifications = verified(verifications, [0, 1], ALL_ACCEPTED)
        produced = [p + K + 1 for p in produced]
    assert made[0] == 3
