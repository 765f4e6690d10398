"""What a chain's next draft must gain to pay for itself, as the scheduler prices it for
the runner (torch-free: the scheduler computes it, the runner's gate reads it)."""

from __future__ import annotations

from typing import NamedTuple


class DraftPrice(NamedTuple):
    """Expected accepted tokens that pay, at the step's forecast tokens per second (the
    goodput policy's step-time model, scheduler/step_cost.py): `per_row`, for what one
    more draft adds to the verification pass and to a drafter pass; `per_pass`, for a
    drafter pass that runs only for the chains that go on (runner/draft_gate.py)."""

    per_row: float
    per_pass: float
