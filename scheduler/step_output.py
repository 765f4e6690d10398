"""Turn a step's charges into the `SchedulerOutput` the runner gets.

Pure: reads the budget (the run planned in bulk, then the one-by-one charges) and
what `Scheduler._apply` collected; changes nothing. Dict orders follow the charges:
the run first, then the rest in the order they were planned.
"""

from __future__ import annotations

import numpy as np

from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.step_budget import StepBudget


def build_output(budget: StepBudget, run_ids: list[str], new_reqs: list[NewRequestData],
                 cached_reqs: CachedRequestData, spec_tokens: dict[str, list[int]],
                 preempted: set[str], finished: set[str],
                 max_num_batched_tokens: int) -> SchedulerOutput:
    """`run_ids`: the request ids of `budget.run`, in its order ([] without a run)."""
    names = budget.rule.pass_names
    rows = [0] * len(names)
    num_scheduled: dict[str, int] = {}
    num_drafts: dict[str, int] = {}
    run = budget.run
    if run is not None:
        rows = run.total_rows
        num_scheduled = dict(zip(run_ids, run.num_tokens.tolist()))
        drafting = np.flatnonzero(run.num_drafts).tolist()
        num_drafts = dict(zip([run_ids[i] for i in drafting],
                              run.num_drafts[drafting].tolist()))
    for rid, plan in budget.charges.items():
        rows = [total + row for total, row in zip(rows, plan.rows)]
        num_scheduled[rid] = plan.num_tokens
        if plan.num_draft_tokens:
            num_drafts[rid] = plan.num_draft_tokens
    pass_rows = dict(zip(names, rows))
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached_reqs,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=pass_rows["target"],
        scheduled_spec_decode_tokens=spec_tokens,
        num_draft_tokens=num_drafts,
        num_drafter_tokens=max(rows[1:], default=0),
        # Only one-by-one plans adapt k: a run's requests all got the k the rule allows.
        adapted_draft_tokens={rid: plan.rule_drafts for rid, plan in budget.charges.items()
                              if plan.rule_drafts > plan.num_draft_tokens},
        pass_rows=pass_rows,
        max_num_batched_tokens=max_num_batched_tokens,
        preempted_req_ids=preempted,
        finished_req_ids=finished,
    )
