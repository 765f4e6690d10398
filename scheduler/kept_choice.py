"""A goodput choice that drafts, kept for the next few steps.

Deciding k costs ~0.6 ms in place whatever the batch size (measured at 4 and 16
running: ~150 numpy calls, each slowed by the forward evicting the policy's code and
data from the caches): 1.5-3 % of a step at 1-4 running. Between two decisions what
moves most is each request's state (its last verification's outcome: all, some or none
of its drafts accepted), and that is what the choice is conditioned on, so a decision
also works out each request's cap for every state its next verification may leave,
against the same threshold (the smallest gain worth a draft). The next steps look the
state up (`KeptChoice.caps_now`) until `GoodputSettings.reuse_steps` have passed, or
the batch changes, or the drafts it gives move far from the decision's (a drafter
pass is paid once for all, so a threshold chosen for many drafters may not pay for
one).

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

    @classmethod
    def of(cls, caps: np.ndarray, gains: np.ndarray, gains_by_state: np.ndarray,
           threshold: float, verifications: np.ndarray, produced: np.ndarray) -> KeptChoice:
        """From a decision: its caps [N] and the gains [N, K] they came from, the gains
        [N, NUM_OUTCOMES, K] each request's drafts would have in each state, and the
        threshold the decision drew."""
        num, k = gains.shape
        by_state = (gains_by_state >= threshold).sum(axis=2)
        pad = np.zeros((num, 1))
        return cls(caps, by_state, np.cumsum(np.hstack([pad, gains]), axis=1),
                   np.cumsum(np.concatenate(
                       [np.zeros((num, NUM_OUTCOMES, 1)), gains_by_state], axis=2), axis=2),
                   verifications.sum(axis=1), produced, k + 1, int(caps.sum()))

    def caps_now(self, verifications: np.ndarray, states: np.ndarray, rule_k: np.ndarray,
                 produced: np.ndarray, steps: int) -> tuple[np.ndarray, float] | None:
        """This step's caps and the accepted drafts they are forecast to get, `steps`
        after the decision; None where the decision no longer holds: other requests
        (a count, or output that could not have grown so), or drafts outside half to
        twice the decision's. A request that entered another span of its answer keeps
        its old span's rates until the next decision, as it keeps its old record."""
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
        if not self.drafts <= 2 * drafts <= 4 * self.drafts:
            return None
        forecast = np.where(verified, self.gains_by_state[rows, states, caps],
                            self.gains[rows, caps])
        return caps, float(forecast.sum())
