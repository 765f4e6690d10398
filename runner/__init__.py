"""Model runner: turns a SchedulerOutput into forward passes (torch loads lazily)."""

from runner.errors import BudgetInvariantError
from runner.invariant import check_pass_rows

__all__ = ["BudgetInvariantError", "check_pass_rows"]
