"""The step being scheduled, in one store: each pass's remaining rows, and one row per
charged request.

Two deciders write it: the bulk plan (scheduler/bulk_plan.py) extends it with the
leading running requests in one numpy pass, then `plan_chunk` appends the rest one
by one. Everything after reads the same columns whoever wrote them: a refund masks a
row, `Scheduler._apply` commits the live rows, `build_output` (step_output.py) sums
them. Columns are allocated once per scheduler (a step charges at most
`max_num_seqs` requests) and reset each step.
"""

from __future__ import annotations

import numpy as np

from scheduler.budget import ChunkPlan, ThrottleRule
from scheduler.request import Request


class StepRecord:
    """Remaining rows of each pass, and per charged request (row i, in the order they
    were planned): n, s, k, the k the rule allowed, rows per pass, lookahead slots, the
    KV blocks held before the step and how many it was given."""

    def __init__(self, rule: ThrottleRule, max_num_batched_tokens: int, capacity: int) -> None:
        self.rule = rule
        self.max_num_batched_tokens = max_num_batched_tokens
        ints = (capacity,)
        self.num_computed = np.zeros(ints, dtype=np.int64)  # c before the step
        self.num_tokens = np.zeros(ints, dtype=np.int64)  # n
        self.num_spec = np.zeros(ints, dtype=np.int64)  # s: drafts verified
        self.num_draft_tokens = np.zeros(ints, dtype=np.int64)  # k: drafts proposed
        self.rule_draft_tokens = np.zeros(ints, dtype=np.int64)  # k the rule allowed (>= k)
        self.rows = np.zeros((capacity, rule.num_passes), dtype=np.int64)
        self.lookahead = np.zeros(ints, dtype=np.int64)
        self.held_blocks = np.zeros(ints, dtype=np.int64)
        self.new_blocks = np.zeros(ints, dtype=np.int64)
        self.samples = np.zeros(ints, dtype=bool)  # the chunk reaches the last known token
        self.live = np.zeros(ints, dtype=bool)  # False: refunded (preempted)
        self.reset()

    def reset(self) -> None:
        """Start a step: every pass gets all of B back, no request charged."""
        self.remaining = self.rule.initial_budget(self.max_num_batched_tokens)
        self.requests: list[Request] = []
        self.num_admitted = 0  # the last rows: admitted from the waiting queue this step
        self.num_refunds = 0  # preemptions that gave rows back after others were planned
        self._index: dict[str, int] | None = None  # request id -> row, built on demand

    @property
    def count(self) -> int:
        return len(self.requests)

    # ---- writing --------------------------------------------------------------

    def extend(self, requests: list[Request], num_computed: np.ndarray, n: np.ndarray,
               s: np.ndarray, k: np.ndarray, rows: np.ndarray, lookahead: np.ndarray,
               held: np.ndarray, new_blocks: np.ndarray, samples: np.ndarray) -> None:
        """Charge many requests at once (the bulk plan: each got the k the rule allows)."""
        start, end = self.count, self.count + len(requests)
        self.requests.extend(requests)
        self.num_computed[start:end] = num_computed
        self.num_tokens[start:end] = n
        self.num_spec[start:end] = s
        self.num_draft_tokens[start:end] = k
        self.rule_draft_tokens[start:end] = k
        self.rows[start:end] = rows
        self.lookahead[start:end] = lookahead
        self.held_blocks[start:end] = held
        self.new_blocks[start:end] = new_blocks
        self.samples[start:end] = samples
        self.live[start:end] = True
        self.remaining = [rem - int(row) for rem, row in zip(self.remaining, rows.sum(axis=0))]
        if self._index is not None:
            self._index.update((r.request_id, i) for i, r in enumerate(requests, start))

    def append(self, request: Request, plan: ChunkPlan, held: int, new_blocks: int,
               admitted: bool = False) -> None:
        """Charge one request (planned by `plan_chunk`)."""
        i = self.count
        self.requests.append(request)
        if self._index is not None:  # (the loop plans each running request once)
            assert request.request_id not in self._index, \
                f"{request.request_id} charged twice in one step"
            self._index[request.request_id] = i
        self.num_computed[i] = request.num_computed_tokens
        self.held_blocks[i] = held
        self.num_admitted += admitted
        self.restore(i, plan, new_blocks)

    def restore(self, i: int, plan: ChunkPlan, new_blocks: int) -> None:
        """(Re)charge row i with `plan`: its place in the step's order is kept."""
        self.num_tokens[i] = plan.num_tokens
        self.num_spec[i] = plan.num_spec
        self.num_draft_tokens[i] = plan.num_draft_tokens
        self.rule_draft_tokens[i] = plan.rule_draft_tokens
        self.rows[i] = plan.rows
        self.lookahead[i] = plan.lookahead
        self.new_blocks[i] = new_blocks
        self.samples[i] = plan.samples
        self.live[i] = True
        self.remaining = [rem - row for rem, row in zip(self.remaining, plan.rows)]

    def refund(self, i: int) -> ChunkPlan:
        """Give back exactly what row i was charged (preempted, or to be re-planned)."""
        assert self.live[i], f"{self.requests[i].request_id} refunded twice"
        plan = self.plan(i)
        self.live[i] = False
        self.remaining = [rem + row for rem, row in zip(self.remaining, plan.rows)]
        self.num_refunds += 1
        return plan

    # ---- reading --------------------------------------------------------------

    def index(self, request_id: str) -> int | None:
        """The live row charged to `request_id`, if any."""
        if self._index is None:  # only preemption asks: most steps never build it
            self._index = {r.request_id: i for i, r in enumerate(self.requests)}
        i = self._index.get(request_id)
        return i if i is not None and self.live[i] else None

    def plan(self, i: int) -> ChunkPlan:
        """Row i as the `ChunkPlan` that `plan_chunk` returns for it."""
        return ChunkPlan(int(self.num_tokens[i]), int(self.num_spec[i]),
                         int(self.num_draft_tokens[i]), tuple(self.rows[i].tolist()),
                         int(self.lookahead[i]), int(self.rule_draft_tokens[i]),
                         bool(self.samples[i]))

    def live_rows(self) -> np.ndarray | slice:
        """The rows still charged, in order: a slice when nothing was refunded."""
        if not self.num_refunds:
            return slice(0, self.count)
        return np.flatnonzero(self.live[:self.count])

    def plans(self) -> list[ChunkPlan]:
        """Every live row as a `ChunkPlan` (tests compare deciders through this)."""
        return [self.plan(i) for i in range(self.count) if self.live[i]]
