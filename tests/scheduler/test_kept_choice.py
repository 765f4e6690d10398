"""A goodput choice that drafts is kept for the next steps, looked up by each request's
state (scheduler/kept_choice.py): the same caps a new decision would give where the
estimates have not moved, and a new decision where the batch or its drafts changed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scheduler.goodput import GoodputPolicy
from scheduler.prefix_search import Best
from scheduler.request import ALL_ACCEPTED, NONE_ACCEPTED, NUM_OUTCOMES, SOME_ACCEPTED
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
    """Counts the decisions `gp` makes (each reads the estimates' rates) and the caps
    per state it builds to keep one (each reads every state's rates)."""
    made = [0]
    for name in ("rates_and_optimism", "rates_by_state"):
        read = getattr(gp.acceptance, name)

        def counted(*args: object, read: object = read, **kwargs: object) -> object:
            made[0] += 1
            return read(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(gp.acceptance, name, counted)
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


def accepting_steps(gp: GoodputPolicy, made: list[int], steps: int) -> list[int]:
    """Two requests that accept every draft, `steps` steps in a row: each step's caps
    must be all K; the decisions made after each step."""
    verifications, produced, after = history([50, 50]), [40, 40], []
    for _ in range(steps):
        assert step(gp, verifications, [ALL_ACCEPTED] * 2, produced) == [K, K]
        verifications = verified(verifications, [0, 1], ALL_ACCEPTED)
        produced = [p + K + 1 for p in produced]
        after.append(made[0])
    return after


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
    assert accepting_steps(gp, made, 7) == [2 * (i // 3 + 1) for i in range(7)]


@pytest.mark.parametrize("change", ["joined", "replaced", "drafts fell", "none drafts"])
def test_a_kept_choice_is_dropped_where_the_batch_changed(
        change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request joined, one was replaced by another (its output could not have
    shrunk), or the drafts fell to under half the decision's but not to none (a
    drafter pass paid for many may not pay for few): the next step decides again.
    Where none drafts, the kept choice holds."""
    gp = runs_policy(reuse_steps=4)
    made = decisions(gp, monkeypatch)
    start = history([50, 50, 50])
    assert step(gp, start, [ALL_ACCEPTED] * 3, [40] * 3) == [K] * 3
    now = verified(start, [0, 1, 2], ALL_ACCEPTED)
    if change == "joined":
        step(gp, np.vstack([now, np.zeros((1, NUM_OUTCOMES), dtype=np.int64)]),
             [ALL_ACCEPTED] * 3 + [0], [45, 45, 45, 0])
    elif change == "replaced":
        step(gp, now, [ALL_ACCEPTED] * 3, [45, 45, 3])
    elif change == "drafts fell":  # K of the decision's 3 K
        step(gp, now, [NONE_ACCEPTED, NONE_ACCEPTED, ALL_ACCEPTED], [41, 41, 45])
    else:
        assert step(gp, now, [NONE_ACCEPTED] * 3, [41] * 3) == [0] * 3
        assert made[0] == 2  # kept
        return
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


@pytest.mark.parametrize("reuse_steps", [1, 4])
def test_a_choice_that_drafts_nothing_is_held_as_long_as_one_that_drafts_is_kept(
        reuse_steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody drafting, nothing is verified and the estimates stand still: a choice
    that drafts nothing, even by a margin too thin to be held on its own, is held for
    the steps a choice that drafts would be kept (none with `reuse_steps` 1)."""
    gp = policy("ngram", 0.02, 0.003, acceptance=0.5, reuse_steps=reuse_steps)
    rng = np.random.default_rng(4)
    gp.acceptance.record([K] * 400, np.minimum(rng.geometric(0.8, 400) - 1, K).tolist(),
                         [NONE_ACCEPTED] * 400)
    made = decisions(gp, monkeypatch)
    for _ in range(8):  # no first draft accepted in 12 verifications
        assert gp.caps(history([12]), np.zeros(1, dtype=np.int64), np.array([NONE_ACCEPTED]),
                       np.full(1, K), produced=np.array([40])).tolist() == [0]
    assert 0 < gp._idle_margin < gp.settings.idle_margin_per_step  # thin
    assert made[0] == 8 // reuse_steps


def test_a_closed_batchs_plan_that_drafts_is_kept_and_not_a_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed batch plans k to finish soonest (scheduler/finish_plan.py): a plan that
    drafts is kept for `reuse_steps` steps in all, every request drafting alike. A
    choice made while the batch was open is not used once it closes."""
    import scheduler.goodput as goodput

    calls: list[int] = []
    plan = goodput.finish_caps
    monkeypatch.setattr(goodput, "finish_caps",
                        lambda *a, **k: calls.append(1) or plan(*a, **k))
    gp = policy("ngram", 0.02, 0.0005, acceptance=0.7, reuse_steps=3, finish_min_running=1)
    num = 6
    verifications, produced = history([40] * num), np.full(num, 20)

    def closed(states: int) -> list[int]:
        return gp.caps(verifications, np.full(num, 24), np.full(num, states), np.full(num, K),
                       remaining=np.full(num, 48), produced=produced).tolist()

    open_caps = gp.caps(verifications, np.full(num, 24), np.full(num, ALL_ACCEPTED),
                        np.full(num, K), produced=produced)
    assert open_caps.any() and not calls
    first = closed(ALL_ACCEPTED)
    assert calls == [1] and len(set(first)) == 1 and first[0] > 0  # planned, alike
    kept = first
    for i in range(5):
        verifications = verifications + np.eye(NUM_OUTCOMES, dtype=np.int64)[ALL_ACCEPTED]
        produced = produced + 2
        got = closed(NONE_ACCEPTED)
        if i % 3 == 2:  # planned again every third step
            kept = got
        assert got == kept  # kept whatever the state
        assert len(calls) == 1 + (i + 1) // 3


def test_nothing_is_kept_past_the_running_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `reuse_max_running` requests each step decides: one finishes or joins
    nearly every step there, and the caps per state would cost more than they save."""
    gp = runs_policy(reuse_steps=4)
    gp.settings = dataclasses.replace(gp.settings, reuse_max_running=1)
    made = decisions(gp, monkeypatch)
    verifications, produced = history([50, 50]), [40, 40]
    for steps in range(1, 4):
        step(gp, verifications, [ALL_ACCEPTED] * 2, produced)
        assert made[0] == steps and gp._kept is None  # no caps per state built
        verifications = verified(verifications, [0, 1], ALL_ACCEPTED)
        produced = [p + K + 1 for p in produced]


def searches(gp: GoodputPolicy, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the prefix searches `gp` makes (`_threshold`)."""
    made = [0]
    search = gp._threshold

    def counted(*args: object) -> tuple[float, float, float, int]:
        made[0] += 1
        return search(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gp, "_threshold", counted)
    return made


def large_step(gp: GoodputPolicy, states: np.ndarray) -> np.ndarray:
    """Caps of 64 running requests in `states`, each with 40 verifications from FRESH."""
    num = len(states)
    return gp.caps(history([40] * num), np.full(num, 20), states, np.full(num, K))


def test_past_reuse_max_running_a_search_is_kept_while_its_fit_stands(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With 64 running the price of a draft is searched once and held for
    `reuse_steps` steps while the time model is not refitted; each request's cap still
    comes from its own gains against it (a request whose state turned to rejecting
    drafts less on a kept step, exactly as a new search with that threshold gives);
    a refit or `reuse_steps` steps force a new search; 32 running search every step."""
    kept, fresh = runs_policy(reuse_steps=4), runs_policy(reuse_steps=1)
    made = searches(kept, monkeypatch)
    accepting = np.full(64, ALL_ACCEPTED)
    first = large_step(kept, accepting)
    assert (first == large_step(fresh, accepting)).all() and first.sum() > 0
    threshold = kept._kept_threshold
    assert made[0] == 1 and threshold is not None
    mixed = accepting.copy()
    mixed[:8] = NONE_ACCEPTED
    got = large_step(kept, mixed)
    assert made[0] == 1  # kept: no search
    monkeypatch.setattr(fresh, "_threshold",
                        lambda *a: (threshold[0], threshold[0], 0.0, threshold[1]))
    assert (got == large_step(fresh, mixed)).all()
    assert got[:8].sum() < got[8:16].sum()  # the rejecting eight, against eight others
    large_step(kept, mixed)
    large_step(kept, mixed)
    assert made[0] == 1  # four steps in all on one search
    large_step(kept, mixed)
    assert made[0] == 2  # reuse_steps passed
    kept.time_model.refits += 1  # as a refit leaves it
    large_step(kept, mixed)
    assert made[0] == 3
    for _ in range(3):
        large_step(kept, np.full(32, ALL_ACCEPTED))
    assert made[0] == 6 and kept._kept_threshold is None


def test_without_reuse_every_large_step_searches(monkeypatch: pytest.MonkeyPatch) -> None:
    """`reuse_steps=1` keeps nothing at any size: the check above is not vacuous."""
    gp = runs_policy(reuse_steps=1)
    made = searches(gp, monkeypatch)
    for _ in range(3):
        large_step(gp, np.full(64, ALL_ACCEPTED))
    assert made[0] == 3


def one_request_policy(seconds_per_row: float, after_all: float, after_some: float,
                       reuse_steps: int, smallest_gain: bool = False) -> GoodputPolicy:
    """A policy whose drafts are accepted `after_all` of the time after a verification
    that accepted all, `after_some` after one that accepted some; with
    `smallest_gain`, a kept choice caps by the smallest gain of the decision's drafts
    (as before the price), not by the price of a draft."""
    gp = policy("ngram", 0.02, seconds_per_row, acceptance=0.5, reuse_steps=reuse_steps)
    rng = np.random.default_rng(2)
    for state, rate in ((ALL_ACCEPTED, after_all), (SOME_ACCEPTED, after_some)):
        accepted = np.minimum(rng.geometric(1 - rate, 2000) - 1, K)
        gp.acceptance.record([K] * 2000, accepted.tolist(), [state] * 2000, [40] * 2000)
    if smallest_gain:
        search = gp.search

        class SmallestGain:
            def best(self, *args: object) -> Best:
                got = search.best(*args)  # type: ignore[arg-type]
                return got._replace(price=got.threshold)

        gp.search = SmallestGain()  # type: ignore[assignment]
    return gp


def decide_then_verify(gp: GoodputPolicy) -> list[int]:
    """One request's caps in state ALL_ACCEPTED, then, one verification later, in state
    SOME_ACCEPTED (a kept step where `reuse_steps` > 1)."""
    verifications, first = history([50]), np.array([25])
    caps = gp.caps(verifications, first, np.array([ALL_ACCEPTED]), np.array([K]),
                   produced=np.array([40])).tolist()
    verifications[0, ALL_ACCEPTED] += 1
    return caps + gp.caps(verifications, first, np.array([SOME_ACCEPTED]), np.array([K]),
                          produced=np.array([41])).tolist()


def test_at_one_request_a_kept_choice_caps_by_the_price_of_a_draft() -> None:
    """One request: a kept step in another state drafts what a new decision there
    drafts, over clocks and rates where the decision drafts 2-4. The smallest gain of
    the decision's drafts is that one request's last draft, and capped by it a state
    that rates that draft a little lower lost it where a new decision kept it (in 11
    of these 20 cases): the check is not vacuous."""
    cut = 0
    for row in (0.001, 0.002, 0.003, 0.004, 0.006):
        for after_all, after_some in ((0.5, 0.45), (0.4, 0.35), (0.6, 0.5), (0.3, 0.27)):
            fresh = decide_then_verify(one_request_policy(row, after_all, after_some, 1))
            kept = decide_then_verify(one_request_policy(row, after_all, after_some, 4))
            assert kept == fresh, (row, after_all, after_some)
            old = decide_then_verify(one_request_policy(row, after_all, after_some, 4,
                                                        smallest_gain=True))
            assert old[1] <= fresh[1]
            cut += old[1] < fresh[1]
    assert cut >= 8
