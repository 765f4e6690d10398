"""A goodput choice that drafts, kept for the next few steps.

Deciding k costs ~0.6 ms in place whatever the batch size (measured at 4 and 16
running: ~150 numpy calls, each slowed by the forward evicting the policy's code and
data from the caches): 1.5-3 % of a step at 1-4 running. Between two decisions what
moves most is each request's state (its last verification's outcome: all, some or none
of its drafts accepted), and that is what the choice is conditioned on, so a decision
also works out each request's cap for every state its next verification may leave,
against the same threshold (the smallest gain worth a draft). The next steps look the
state up (`KeptChoice.caps_now`) until `GoodputSettings.reuse_steps` have passed, or
the batch changes, or the drafts it gives move far from the decision's.

A closed batch's plan (scheduler/finish_plan.py: every request drafts alike, to finish
the batch soonest) is kept the same way, its caps the same in every state.

The estimates and the step-time fit learn on every step as before; only their reading
waits for the next decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.request import NUM_OUTCOMES


@dataclass(frozen=True)
class KeptChoice:
    """A decision's caps for the requests running then, in the order they ran."""

    caps: np.ndarray  # [N] the caps chosen
    # [N, NUM_OUTCOMES] each request's cap once it has verified again, by the state
    # that verification left (the rates of that state, the threshold of the decision).
    caps_by_state: np.ndarray
    gains: np.ndarray  # [N, K + 1] forecast accepted drafts at each cap (0..K)
    gains_by_state: np.ndarray  # [N, NUM_OUTCOMES, K + 1]
    verified: np.ndarray  # [N] each request's verifications at the decision
    produced: np.ndarray  # [N] its output tokens then
    step_tokens: int  # the most output tokens a request makes in a step (K + 1)
    drafts: int  # drafts the decision allowed
    planned: bool = False  # a closed batch's plan (scheduler/finish_plan.py)

    @classmethod
    def of(cls, caps: np.ndarray, gains: np.ndarray, gains_by_state: np.ndarray,
           threshold: float, verifications: np.ndarray, produced: np.ndarray) -> KeptChoice:
        """From a decision: its caps [N] and the gains [N, K] they came from, the gains
        [N, NUM_OUTCOMES, K] each request's drafts would have in each state, and the
        threshold the decision drew."""
        return cls(caps, (gains_by_state >= threshold).sum(axis=2), _cumulative(gains),
                   _cumulative(gains_by_state), verifications.sum(axis=1), produced,
                   gains.shape[1] + 1, int(caps.sum()))

    @classmethod
    def of_plan(cls, caps: np.ndarray, gains: np.ndarray, verifications: np.ndarray,
                produced: np.ndarray) -> KeptChoice:
        """From a closed batch's plan: its caps [N] (every request alike, whatever its
        state) and the gains [N, K] they came from."""
        cum = _cumulative(gains)
        return cls(caps, np.repeat(caps[:, None], NUM_OUTCOMES, axis=1), cum,
                   np.repeat(cum[:, None, :], NUM_OUTCOMES, axis=1),
                   verifications.sum(axis=1), produced, gains.shape[1] + 1,
                   int(caps.sum()), planned=True)

    def caps_now(self, verifications: np.ndarray, states: np.ndarray, rule_k: np.ndarray,
                 produced: np.ndarray, steps: int) -> tuple[np.ndarray, float] | None:
        """This step's caps and the accepted drafts they are forecast to get, `steps`
        after the decision; None where the decision no longer holds: other requests
        (a count, or output that could not have grown so), or drafts under half the
        decision's but some (a drafter pass paid for many may not pay for a few), or
        over twice them and K more (past a knot of the step-time model rows cost
        more). A request that entered another span of its answer keeps its old
        span's rates until the next decision, as it keeps its old record."""
        if len(rule_k) != len(self.caps):
            return None
        grown = produced - self.produced
        if (grown < 0).any() or (grown > steps * self.step_tokens).any():
            return None
        rows = np.arange(len(rule_k))
        verified = verifications.sum(axis=1) != self.verified
        caps = np.minimum(np.where(verified, self.caps_by_state[rows, states], self.caps),
                          rule_k)
        drafts = int(caps.sum())
        if 0 < 2 * drafts < self.drafts or drafts > max(2 * self.drafts,
                                                         self.drafts + self.step_tokens - 1):
            return None
        forecast = np.where(verified, self.gains_by_state[rows, states, caps],
                            self.gains[rows, caps])
        return caps, float(forecast.sum())


def _cumulative(gains: np.ndarray) -> np.ndarray:
    """[..., K + 1] the accepted drafts forecast at each cap 0..K, from the gains
    [..., K] of each draft."""
    pad = np.zeros((*gains.shape[:-1], 1))
    return np.cumsum(np.concatenate([pad, gains], axis=-1), axis=-1)
