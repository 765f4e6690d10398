"""The goodput policy's plan for a batch that nobody joins: k chosen to finish it soonest.

Per step, the goodput policy maximises the step's output tokens per second. That is the
right aim while a finished request's slot is refilled. A batch that nobody will join (an
offline `generate` once its queue is empty) ends with its slowest request, so there the
aim is the least time to finish every running request. A draft given to a request that
finishes before the slowest one buys no step: every step pays its constant whatever the
rows, and every output token costs its row either way, so the draft's rejected rows and
its drafter rows are pure cost (measured: drafts to the requests rated highest at 64
running saved 0 of 70 steps).

The plan: request i proposing k drafts every step gains e_i(k) = 1 + its expected
accepted drafts per step, so its remaining tokens R_i (bounded by max_tokens and
max_model_len) take S_i(k) = R_i / e_i(k) steps. For each horizon "every request drafts
min(c, its rule's k)" (c = 0..K), each request gets the smallest k that still finishes
within that horizon, and the run is priced step by step with the step-time model: while
j requests remain, the step holds their rows and passes. The cheapest horizon wins; c =
0 (no drafts) is always a candidate, so k is 0 wherever the model predicts drafting
does not pay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from scheduler.step_cost import DraftCosts, StepTimeModel


def finish_caps(gains: np.ndarray, limit: np.ndarray, remaining: np.ndarray,
                catch_up: np.ndarray, costs: DraftCosts, model: StepTimeModel,
                budget: int, min_gain: float = 0.0) -> tuple[np.ndarray, float]:
    """[N] each request's k for the plan that finishes the batch in the least predicted
    time, and by how much the best plan with drafts misses the bar when none wins
    (its time over the time without drafts, less `min_gain`: 0.1 is 10 % short; 0.0
    when drafts win). gains [N, K]: the chance its first j + 1
    drafts are all accepted (0 past its rule's k); limit [N]: its rule's k; remaining
    [N]: output tokens it may still make; catch_up [N]: rows its parked drafter replays
    before its first draft; min_gain: the share of the time without drafts a plan
    with drafts must save to be chosen."""
    num, max_k = gains.shape
    ks = np.arange(max_k + 1)
    per_step = 1.0 + np.concatenate([np.zeros((num, 1)), np.cumsum(gains, axis=1)], axis=1)
    steps = np.maximum(remaining, 1)[:, None] / per_step  # [N, K + 1]
    steps[ks[None, :] > limit[:, None]] = np.inf
    uniform = np.minimum(ks[None, :], limit[:, None])  # [N, C]: request i's k at c
    horizons = np.take_along_axis(steps, uniform, axis=1).max(axis=0)  # [C]
    # The smallest k within each horizon (the one at c always is: argmax finds a True).
    within = steps[None, :, :] <= horizons[:, None, None] * (1.0 + 1e-9)  # [C, N, K + 1]
    chosen = within.argmax(axis=2)  # [C, N]
    seconds = _plan_seconds(chosen, steps[np.arange(num)[None, :], chosen], catch_up,
                            costs, model)
    seconds[(costs.target_at[chosen].sum(axis=1) > budget) & (ks > 0)] = np.inf
    seconds[1:] /= 1.0 - min_gain
    best = int(np.argmin(seconds))
    margin = float(seconds[1:].min() / seconds[0] - 1.0) if best == 0 and max_k else 0.0
    return chosen[best], margin


def _plan_seconds(chosen: np.ndarray, steps: np.ndarray, catch_up: np.ndarray,
                  costs: DraftCosts, model: StepTimeModel) -> np.ndarray:
    """[C] predicted seconds to finish under each candidate's ks [C, N], each request
    running steps [C, N] steps: segments between successive finishes, longest first."""
    num_plans = len(chosen)
    order = np.argsort(-steps, axis=1, kind="stable")
    k = np.take_along_axis(chosen, order, axis=1)
    left = np.take_along_axis(steps, order, axis=1)
    length = left - np.concatenate([left[:, 1:], np.zeros((num_plans, 1))], axis=1)
    target = np.cumsum(costs.target_at[k], axis=1)  # while the first j + 1 remain
    drafter = np.cumsum(costs.drafter_at[k], axis=1)
    passes = costs.passes_at_depth(np.maximum.accumulate(k, axis=1))
    per_step = model.predict(target, target, drafter, passes)  # [C, N]
    total = (length * per_step).sum(axis=1)
    # A parked drafter's replay, once, at the price of a drafter row (measured at the
    # plan's first step: one more row there).
    replay = ((chosen > 0) * catch_up[None, :]).sum(axis=1)
    if not replay.any():
        return total
    row = (model.predict(target[:, -1], target[:, -1], drafter[:, -1] + 1, passes[:, -1])
           - per_step[:, -1])
    return total + replay * np.maximum(row, 0.0)
