"""What a drafter's acceptance was measured to be before it serves (torch-free: the
runner reads it from a trained head's directory, the engine hands it to the scheduler)."""

from __future__ import annotations

from typing import NamedTuple


class MeasuredAcceptance(NamedTuple):
    """Acceptance of each draft position given the ones before it were accepted, and
    how many verifications it was measured on (0 where it is an offline proxy, such as
    a head's held-out agreement, not drafts served and verified), and how often its
    chains reach each draft."""

    rates: tuple[float, ...]
    verifications: int = 0
    # A gated chain drafter's chance of proposing its j-th draft where allowed j
    # (runner/draft_gate.py), measured with the gate at `gate` (`min_draft_confidence`);
    # empty: every allowed draft proposed.
    proposal_rates: tuple[float, ...] = ()
    gate: float = 0.0
