"""The runner's side of the budget contract: count what was built, then assert.

The runner never asks the drafter layout what a pass should hold; it counts the rows
it actually put together and checks them against B and against what the scheduler
declared, before a single buffer write.
"""

from __future__ import annotations

import numpy as np

from runner.errors import BudgetInvariantError


def check_pass_rows(method: str | None, max_num_batched_tokens: int,
                    built: dict[str, int], declared_drafter_rows: int) -> None:
    """Assert every pass <= B and the widest drafter pass == the declared rows.

    `built` maps each pass ("target" first, then the drafter's passes in any order)
    to the rows the runner constructed for it.
    """
    label = method or "none"
    for name, rows in built.items():
        if rows > max_num_batched_tokens:
            raise BudgetInvariantError(
                f"method={label}: pass {name!r} built {rows} rows, more than "
                f"max_num_batched_tokens={max_num_batched_tokens}"
            )
    widest = max((rows for name, rows in built.items() if name != "target"), default=0)
    if widest != declared_drafter_rows:
        raise BudgetInvariantError(
            f"method={label}: widest drafter pass built {widest} rows but "
            f"SchedulerOutput.num_drafter_tokens declared {declared_drafter_rows}"
        )


def check_draft_counts(method: str | None, req_ids: list[str], declared: np.ndarray,
                       allowed: np.ndarray) -> None:
    """Refuse a step that declares more drafts for a request than DESIGN.md §2's k rule
    allows, as the runner re-derives it from its own copy of the request's lengths
    and limits (0 for a chunk that does not sample). A scheduler that ignored the rule
    would otherwise size passes past what their buffers hold, or write past
    max_model_len."""
    over = np.flatnonzero(declared > allowed)
    if over.size:
        i = int(over[0])
        raise BudgetInvariantError(
            f"method={method or 'none'}: request {req_ids[i]!r} was declared "
            f"k={int(declared[i])} drafts but the k rule allows {int(allowed[i])} "
            f"({over.size} request(s) over the rule this step)")
