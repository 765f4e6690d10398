"""Errors the runner raises."""


class BudgetInvariantError(RuntimeError):
    """A forward pass the runner built disagrees with the scheduler's budget.

    Raised before any buffer is written, naming the method, the pass and both counts.
    """
