"""The ledger of the step being scheduled: each pass's remaining rows and who paid what.

Apart from the rules (budget.py, pure: what a chunk costs and whether it fits) and the
whole-run planner (running_plan.py, which uses those rules), so that neither of them
imports the other's caller.
"""

from __future__ import annotations

from scheduler.budget import ChunkPlan, ThrottleRule
from scheduler.running_plan import RunPlan


class StepBudget:
    """Remaining rows of each pass in the step being scheduled, and who paid what.

    `run` holds the leading running requests planned together (`charge_run`),
    `charges` everyone planned one by one after them; a refund inside the run turns
    it into single charges first, keeping the order.
    """

    def __init__(self, rule: ThrottleRule, max_num_batched_tokens: int) -> None:
        self.rule = rule
        self.remaining = rule.initial_budget(max_num_batched_tokens)
        self.run: RunPlan | None = None
        self.charges: dict[str, ChunkPlan] = {}
        self.num_refunds = 0  # preemptions that gave rows back after others were planned

    def charge_run(self, run: RunPlan) -> None:
        assert self.run is None and not self.charges, "the run is charged first"
        self.run = run
        self.remaining = [rem - row for rem, row in zip(self.remaining, run.total_rows)]

    def charge(self, req_id: str, plan: ChunkPlan) -> None:
        # The run's requests are never planned again (a refund ends the run first).
        assert req_id not in self.charges, f"{req_id} charged twice in one step"
        self.charges[req_id] = plan
        self.remaining = [rem - row for rem, row in zip(self.remaining, plan.rows)]

    def is_charged(self, req_id: str) -> bool:
        return req_id in self.charges or (
            self.run is not None and any(r.request_id == req_id for r in self.run.requests))

    def refund(self, req_id: str) -> ChunkPlan:
        """Give back exactly what `req_id` was charged (preempted, or to be re-planned)."""
        if self.run is not None and req_id not in self.charges:
            self.charges = {**self.run.chunk_plans(), **self.charges}
            self.run = None
        plan = self.charges.pop(req_id)
        self.remaining = [rem + row for rem, row in zip(self.remaining, plan.rows)]
        self.num_refunds += 1
        return plan
