"""Model-free proposers: the interface the runner calls for ngram and suffix drafting.

Model-based drafters (draft_model, eagle, mtp, parallel, pard, dflash) run forward
passes inside the runner's budgeted buffers and live in `runner/drafter*.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class TokenProposer(ABC):
    """Proposes up to k drafts per request from token ids alone (no forward pass).

    The runner calls `add_request` when a request starts (or restarts after
    preemption), `propose` once per step for each request that samples with k >= 1,
    and `remove_request` when it finishes (`finished=True`) or is preempted.
    A proposer may return fewer than k drafts (even none); never more.
    """

    def add_request(self, req_id: str, token_ids: np.ndarray) -> None:  # noqa: B027
        """A request starts with these known tokens (prompt, plus outputs if resumed)."""

    def remove_request(self, req_id: str, finished: bool) -> None:  # noqa: B027
        """The request left; `finished` responses may feed later proposals."""

    @abstractmethod
    def propose(self, req_id: str, token_ids: np.ndarray, k: int) -> list[int]:
        """Up to k drafts to follow `token_ids` (all known tokens, newest last)."""
