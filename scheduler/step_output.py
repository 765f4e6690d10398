"""Turn a step's record into the `SchedulerOutput` the runner gets.

Pure: reads the live rows of the step record and what `Scheduler._apply` collected;
changes nothing. Dict orders follow the record's rows: the order requests were planned.
"""

from __future__ import annotations

import numpy as np

from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.step_record import StepRecord


def build_output(record: StepRecord, req_ids: list[str], new_reqs: list[NewRequestData],
                 cached_reqs: CachedRequestData, spec_tokens: dict[str, list[int]],
                 preempted: set[str], finished: set[str],
                 max_shadows: int = 0, shadow_start: int = 0) -> SchedulerOutput:
    """`req_ids`: the ids of the record's live rows, in order. `max_shadows`: ask the
    runner for the draft of at most that many requests that sample with k = 0
    (`SchedulerOutput.shadow_req_ids`), taken in turn from `shadow_start` (mod their
    count) where more sample so."""
    live = record.live_rows()
    rows = record.rows[live].sum(axis=0).tolist()
    k, rule_k = record.num_draft_tokens[live], record.rule_draft_tokens[live]
    drafting = np.flatnonzero(k).tolist()
    adapted = np.flatnonzero(rule_k > k).tolist()
    pass_rows = dict(zip(record.rule.pass_names, rows))
    shadowed = _in_turn(np.flatnonzero(record.samples[live] & (k == 0)), max_shadows,
                        shadow_start) if max_shadows else []
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached_reqs,
        num_scheduled_tokens=dict(zip(req_ids, record.num_tokens[live].tolist())),
        total_num_scheduled_tokens=pass_rows["target"],
        scheduled_spec_decode_tokens=spec_tokens,
        num_draft_tokens=dict(zip([req_ids[i] for i in drafting],
                                  k[drafting].tolist())),
        num_drafter_tokens=max(rows[1:], default=0),
        adapted_draft_tokens=dict(zip([req_ids[i] for i in adapted],
                                      rule_k[adapted].tolist())),
        pass_rows=pass_rows,
        preempted_req_ids=preempted,
        finished_req_ids=finished,
        shadow_req_ids=[req_ids[i] for i in shadowed],
    )


def _in_turn(rows: np.ndarray, most: int, start: int) -> list[int]:
    """At most `most` of `rows`, the run from `start` (mod their count) on, wrapping."""
    if len(rows) <= most:
        return rows.tolist()
    first = start % len(rows)
    return np.roll(rows, -first)[:most].tolist()
