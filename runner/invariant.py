"""The runner's side of the budget contract: count what it assembles, then assert.

Before a step writes any buffer or request state, both runners (the model runner and
`SimulatedRunner`) call `check_step`: it re-derives each request's largest allowed k
from the runner's own copy of its lengths and limits, has every pass's rows per
request planned from the method's recipes (`plan_step_rows`, spec_decode/passes.py:
planning lives there, never in the cost table the scheduler charged from; this module
only checks), bounds each request's rows inside its own KV slots and max_model_len,
and checks each pass against the runner's B and against what the scheduler charged.
After verification, `check_filled` bounds every row that reads something (drafts,
target hidden states) inside its own request's slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runner.errors import BudgetInvariantError
from scheduler.outputs import SchedulerOutput
from spec_decode.methods import SpecMethod
from spec_decode.passes import MASK_ROW, DraftPass, StepRows, plan_step_rows


@dataclass
class StepFacts:
    """The runner's own copy of each scheduled request's counters, before the step."""

    num_tokens: np.ndarray  # [R] known tokens: prompt + output
    num_prompt: np.ndarray  # [R]
    num_computed: np.ndarray  # [R] c
    max_tokens: np.ndarray  # [R]
    num_spec: np.ndarray  # [R] s: drafts verified this step
    kv_slots: np.ndarray | None = None  # [R] KV slots allocated once this step's blocks land
    # [R] positions the drafter's own KV holds (w <= c; below c while parked); None: c
    drafter_computed: np.ndarray | None = None

    @property
    def behind(self) -> np.ndarray:
        """[R] rows each request's drafter skipped while parked: c - w."""
        if self.drafter_computed is None:
            return np.zeros_like(self.num_computed)
        return self.num_computed - self.drafter_computed


def allowed_drafts(facts: StepFacts, n: np.ndarray, max_k: int,
                   max_model_len: int) -> np.ndarray:
    """DESIGN.md §2's k rule, re-derived: 0 for a chunk that does not sample."""
    tokens, s = facts.num_tokens, facts.num_spec
    rule = np.minimum(max_model_len - (tokens + s + 2),
                      facts.max_tokens - (tokens - facts.num_prompt + s) - 2)
    samples = facts.num_computed + n >= tokens
    return np.where(samples, np.clip(rule, 0, max_k), 0)


def check_step(method: SpecMethod | None, out: SchedulerOutput, req_ids: list[str],
               n: np.ndarray, k: np.ndarray, facts: StepFacts, max_k: int,
               max_model_len: int, max_num_batched_tokens: int, parks: bool = False
               ) -> StepRows:
    """All of the runner's pre-write checks; the assembled rows to fill afterwards.

    `max_num_batched_tokens` is the runner's own B, the one its buffers were sized
    by: a SchedulerOutput declaring a larger B is held to the runner's. `parks`: the
    runner's own `SpeculativeConfig.parks`."""
    name = method.name if method else None
    check_draft_counts(name, req_ids, k, allowed_drafts(facts, n, max_k, max_model_len))
    behind = facts.behind
    _check_behind(name, req_ids, behind)
    samples = facts.num_computed + n >= facts.num_tokens
    step = plan_step_rows(method, n, k, behind if parks else None, samples if parks else None)
    last = facts.num_computed + n - 1  # the target pass's last position per request
    bounds = [("target", last)]
    if method is not None:
        for rows in step.passes:
            # Worst case L = n: a pass without context rows starts at c + n; one with
            # them at c - b (b rows caught up).
            first = (facts.num_computed - behind if rows.recipe.context
                     else facts.num_computed + n)
            bounds.append((rows.name, np.where(rows.rows > 0, first + rows.rows - 1, -1)))
        if method.sequential:
            shift, depth = method.recipes[0].shift, method.depth(k)  # a tree: its depth
            bounds.append(("step_*", np.where(depth > 1,
                                              facts.num_computed + n + depth - 1 - shift, -1)))
    check_pass_rows(name, max_num_batched_tokens, step.counts, out.num_drafter_tokens,
                    out.pass_rows)
    for pass_name, last_pos in bounds:
        _check_positions(name, pass_name, req_ids, last_pos, facts, max_model_len)
    return step


def _check_behind(method: str | None, req_ids: list[str], behind: np.ndarray) -> None:
    """A drafter never holds positions its target has not computed (w <= c)."""
    bad = np.flatnonzero(behind < 0)
    if bad.size:
        i = int(bad[0])
        raise BudgetInvariantError(
            f"method={method or 'none'}: request {req_ids[i]!r}'s drafter is "
            f"{-int(behind[i])} positions ahead of its target")


def _check_positions(method: str | None, pass_name: str, req_ids: list[str],
                     last: np.ndarray, facts: StepFacts, max_model_len: int) -> None:
    """Every row of a request must write a KV slot it owns, below max_model_len."""
    limit = np.full_like(last, max_model_len)
    if facts.kv_slots is not None:
        limit = np.minimum(limit, facts.kv_slots)
    over = np.flatnonzero(last >= limit)
    if over.size:
        i = int(over[0])
        raise BudgetInvariantError(
            f"method={method or 'none'}: pass {pass_name!r} would write position "
            f"{int(last[i])} of request {req_ids[i]!r}, which holds {int(limit[i])} "
            f"slots (max_model_len={max_model_len})")


def check_pass_rows(method: str | None, max_num_batched_tokens: int,
                    built: dict[str, int], declared_drafter_rows: int,
                    charged: dict[str, int] | None = None) -> None:
    """Assert every pass <= B, each charged drafter pass == its built rows, and the
    widest drafter pass == the declared rows.

    `built` maps each pass ("target" first, then the drafter's passes and one-row
    steps) to the rows the runner assembled for it; `charged` the scheduler's
    `SchedulerOutput.pass_rows`. The target pass is not compared with its charge: a
    benchmark's vLLM rule charges it n + S.
    """
    label = method or "none"
    for name, rows in built.items():
        if rows > max_num_batched_tokens:
            raise BudgetInvariantError(
                f"method={label}: pass {name!r} built {rows} rows, more than "
                f"max_num_batched_tokens={max_num_batched_tokens}")
    for name, rows in (charged or {}).items():
        if name != "target" and built.get(name, 0) != rows:
            raise BudgetInvariantError(
                f"method={label}: pass {name!r} built {built.get(name, 0)} rows but the "
                f"scheduler charged {rows}")
    widest = max((rows for name, rows in built.items()
                  if name != "target" and not name.startswith("step_")), default=0)
    if widest != declared_drafter_rows:
        raise BudgetInvariantError(
            f"method={label}: widest drafter pass built {widest} rows but "
            f"SchedulerOutput.num_drafter_tokens declared {declared_drafter_rows}")


def check_draft_counts(method: str | None, req_ids: list[str], declared: np.ndarray,
                       allowed: np.ndarray) -> None:
    """Refuse a step that declares more drafts for a request than the k rule allows,
    as the runner re-derives it (0 for a chunk that does not sample). A scheduler that
    ignored the rule would otherwise size passes past what their buffers hold, or
    write past max_model_len."""
    over = np.flatnonzero(declared > allowed)
    if over.size:
        i = int(over[0])
        raise BudgetInvariantError(
            f"method={method or 'none'}: request {req_ids[i]!r} was declared "
            f"k={int(declared[i])} drafts but the k rule allows {int(allowed[i])} "
            f"({over.size} request(s) over the rule this step)")


def check_filled(method: str, draft_pass: DraftPass, q_start: np.ndarray,
                 num_scheduled: np.ndarray, computed: np.ndarray | None = None) -> None:
    """Rows read for drafts lie in their own request's slice of the pass, rows
    conditioned on the target read its hidden states from their own request's rows,
    and catch-up rows read cached features only below c (`computed`), where the
    target wrote them in earlier steps."""
    readout, slice_start = draft_pass.readout, draft_pass.slice_starts
    # Each request's reads are request-major: the i-th read belongs to `readers[i]`.
    readers = np.repeat(np.arange(len(slice_start)), draft_pass.reads_per_req)
    if len(readers) != len(readout) or (
            (readout < slice_start[readers]).any()
            or (readout >= (slice_start + draft_pass.rows_per_req)[readers]).any()):
        raise BudgetInvariantError(
            f"method={method}: pass {draft_pass.name!r} reads drafts from rows outside "
            "their request's slice")
    src = draft_pass.hidden_src
    req = draft_pass.req_index
    conditioned = src != MASK_ROW
    if ((src[conditioned] < q_start[req[conditioned]]).any()
            or (src[conditioned] >= (q_start + num_scheduled)[req[conditioned]]).any()):
        raise BudgetInvariantError(
            f"method={method}: pass {draft_pass.name!r} reads target hidden states "
            "outside its request's rows")
    cached = draft_pass.cached
    if (cached & conditioned).any() or (
            computed is not None and (draft_pass.positions[cached] >= computed[req[cached]]).any()):
        raise BudgetInvariantError(
            f"method={method}: pass {draft_pass.name!r} reads cached target features at "
            "positions its target has not computed before this step")

