"""Drafter passes assembled row by row from a method's recipes (numpy only).

Two stages, so that the runner can count and bound every row before it writes
anything, and fill them only once verification says what they hold:

1. `assemble_rows` (before the step): per request and pass, how many rows of each
   segment (context, bonus, masks) the recipe lays out for n scheduled tokens and k
   drafts. Their sum is what the runner counts against B and against the charge.
2. `fill_pass` (after verification): the same rows, now with positions, token ids and
   hidden-state sources: L real tokens (L = n - s + accepted), the bonus token, mask
   rows, then padding that only fills positions the drafter overwrites before it
   reads them (they sit at or past the first position the next step recomputes).

Per request: c = computed before the step, n = scheduled, L = valid positions after
verification (n when the chunk does not sample), k = drafts to propose, b = rows its
drafter fell behind while parked (`context_rows`, spec_decode/methods/base.py). A
parked request has no rows in the context passes; one that catches up starts its
context segment at c - b, and those b rows read the target's features from the
drafter's feature cache (`DraftPass.cached`) instead of this step's target pass. The
real runner and `SimulatedRunner` both build their passes here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from spec_decode.methods import PassRecipe, SpecMethod, context_rows
from spec_decode.price import DraftPrice

MASK_ROW = -1  # hidden_src of a row with no target hidden state (mask / query rows)


@dataclass
class StepResult:
    """Per scheduled request (scheduled order), what verification left behind."""

    rows: np.ndarray  # [R] rows of the token-id array (the runner's state rows)
    computed: np.ndarray  # [R] c
    num_scheduled: np.ndarray  # [R] n
    q_start: np.ndarray  # [R] first target-pass row of each request
    valid: np.ndarray  # [R] L
    samples: np.ndarray  # [R] bool
    num_draft_tokens: np.ndarray  # [R] k (0 when not sampling)
    catch_up: np.ndarray  # [R] b: rows before c the context passes catch up (0: none)
    # [R] drafts verified this step, and how many of them were accepted (None: not
    # told; a chain drafter's gate learns from them, runner/draft_calibration.py).
    num_spec: np.ndarray | None = None
    accepted: np.ndarray | None = None
    # What a chain's next draft must gain this step (`SchedulerOutput.draft_price`).
    draft_price: DraftPrice | None = None


@dataclass
class PassRows:
    """One pass's rows per request, by segment, before the step runs."""

    recipe: PassRecipe
    context: np.ndarray  # [R] n, or 0 for a pass without context rows
    bonus: np.ndarray  # [R] 1 for a drafting request whose recipe has a bonus row
    masks: np.ndarray  # [R] mask rows
    reads: np.ndarray  # [R] rows read out as drafts (a depth each: a tree's T candidates)

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def rows(self) -> np.ndarray:
        return self.context + self.bonus + self.masks

    @property
    def total(self) -> int:
        return int(self.rows.sum())


@dataclass
class DraftPass:
    """One pass's rows; `readout` lists the rows whose outputs become drafts."""

    name: str
    req_index: np.ndarray  # [rows] scheduled-request index of each row
    positions: np.ndarray  # [rows]
    token_ids: np.ndarray  # [rows]
    hidden_src: np.ndarray  # [rows] target-pass row to read, or MASK_ROW
    rows_per_req: np.ndarray  # [R]
    starts: np.ndarray  # [R] first position of each request's rows
    readout: np.ndarray  # [sum drafts read here] pass-row indices, request-major
    reads_per_req: np.ndarray  # [R] drafts each request reads here
    # [rows] conditioned catch-up rows: they read the target's features at their
    # position from the drafter's feature cache (their hidden_src is MASK_ROW).
    cached: np.ndarray
    # [R] each request's rows before its padding (its tokens, bonus and masks), where
    # `fill_pass` filled it; None: the pass has no padding.
    unpadded: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.positions)

    def without_padding(self) -> DraftPass:
        """The same pass less each request's padding rows (those past its tokens, bonus
        and masks, over drafts verification rejected): they sit at or past the first
        position the next step recomputes, so nothing reads what they would write
        before it is rewritten, and no readout row is among them. The pass the
        scheduler charged and the runner checked keeps them; a drafter need not run
        them (eagle verifying a tree of 8, one draft accepted: 9 rows charged, 2 run)."""
        if self.unpadded is None or np.array_equal(self.unpadded, self.rows_per_req):
            return self
        j = np.arange(self.num_rows) - np.repeat(self.slice_starts, self.rows_per_req)
        keep = j < self.unpadded[self.req_index]
        dropped_before = np.cumsum(~keep) - ~keep
        return DraftPass(self.name, self.req_index[keep], self.positions[keep],
                         self.token_ids[keep], self.hidden_src[keep], self.unpadded,
                         self.starts, self.readout - dropped_before[self.readout],
                         self.reads_per_req, self.cached[keep])  # no padding left

    @property
    def slice_starts(self) -> np.ndarray:
        """[R] first pass row of each request's slice."""
        return np.cumsum(self.rows_per_req) - self.rows_per_req

    def readout_block(self) -> ReadoutBlock | None:
        """The readout rows as a pass of their own, or None where they are not one: each
        request's readout rows must be consecutive positions, so that as a query block
        ending its sequence they attend to exactly the keys they attend to here (rows
        past them, padding over rejected drafts, are rewritten before anything reads
        them and stay out)."""
        reqs = np.flatnonzero(self.reads_per_req > 0)
        per_req = self.reads_per_req[reqs]
        positions = self.positions[self.readout]
        if not len(reqs) or np.any(np.diff(self.readout) <= 0):
            return None
        seq_lens = positions[np.cumsum(per_req) - 1] + 1
        first = np.repeat(np.cumsum(per_req) - per_req, per_req)
        offsets = np.arange(len(positions)) - first
        if not np.array_equal(positions, np.repeat(seq_lens - per_req, per_req) + offsets):
            return None
        return ReadoutBlock(reqs, per_req, seq_lens)


@dataclass(frozen=True)
class ReadoutBlock:
    """A pass's readout rows as a pass of their own (`DraftPass.readout_block`)."""

    reqs: np.ndarray  # [A] the requests that read out here
    per_req: np.ndarray  # [A] their readout rows
    seq_lens: np.ndarray  # [A] one past the last readout position of each


def assemble_rows(method: SpecMethod, n: np.ndarray, k: np.ndarray,
                  context: np.ndarray | None = None) -> list[PassRows]:
    """Each wide pass's segments per request, from the method's recipes; `context`:
    each request's rows in the context passes (`context_rows`; default n)."""
    drafting = (k > 0).astype(np.int64)
    depth = method.depth(k)
    zero = np.zeros_like(n)
    ctx = n if context is None else context
    passes = []
    for recipe in method.recipes:
        masks = (zero if recipe.masks is None
                 else drafting * np.maximum(depth + recipe.masks, 0))
        reads = {"none": zero, "one": drafting, "all": depth}[recipe.reads]
        passes.append(PassRows(recipe, ctx if recipe.context else zero,
                               drafting if recipe.bonus else zero, masks, reads))
    return passes


def sequential_rows(method: SpecMethod, k: np.ndarray) -> list[int]:
    """Rows of each one-row-per-request step after the first pass (steps 1 .. k - 1)."""
    if not method.sequential:
        return []
    depth = method.depth(k)
    return [int((depth > j).sum()) for j in range(1, int(depth.max(initial=0)))]


@dataclass
class StepRows:
    """Every pass the step will build, counted from its assembled rows (the runner plans
    them with `plan_step_rows`, checks them in runner/invariant.py, then fills them)."""

    passes: list[PassRows] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # target, wide passes, step_j
    parked: np.ndarray | None = None  # [R] no rows in the context passes (None: nobody)
    catch_up: np.ndarray | None = None  # [R] b of each request that catches up, else 0


def plan_step_rows(method: SpecMethod | None, n: np.ndarray, k: np.ndarray,
                   behind: np.ndarray | None = None,
                   samples: np.ndarray | None = None) -> StepRows:
    """The target pass (n rows per request), every drafter pass assembled from the
    method's recipes, and the sequential one-row steps, each with its row count.
    `behind` and `samples` (both or neither): the runner's own count of the rows each
    request's drafter is behind, and which chunks sample; without them nobody parks."""
    step = StepRows(counts={"target": int(n.sum())})
    if method is None:
        return step
    context = None
    if behind is not None and samples is not None:
        context = context_rows(method.parks, n, k, behind, samples)
        step.parked = context == 0
        step.catch_up = np.where(step.parked, 0, behind)
    step.passes = assemble_rows(method, n, k, context)
    for rows in step.passes:
        step.counts[rows.name] = rows.total
    for j, count in enumerate(sequential_rows(method, k), start=1):
        step.counts[f"step_{j}"] = count
    return step


def fill_pass(plan: PassRows, res: StepResult, token_ids: np.ndarray | None,
              mask_id: int) -> DraftPass:
    """The pass's rows with their contents; `token_ids` [rows, len] (None: zeros).

    Worked example, rows [3, 2], real [2, 2], masks [1, 0], starts [5, 0]:
      req_index = [0, 0, 0, 1, 1]; j = [0, 1, 2, 0, 1]; positions = [5, 6, 7, 0, 1]
      kinds     = [tok, tok, mask, tok, tok]
    """
    recipe, rows = plan.recipe, plan.rows
    c, L = res.computed, res.valid
    context_real = res.catch_up + L if recipe.context else np.zeros_like(L)
    real = context_real + plan.bonus
    starts = c - res.catch_up if recipe.context else c + L
    num = len(rows)
    cu = np.cumsum(rows)
    req_index = np.repeat(np.arange(num), rows)
    j = np.arange(int(cu[-1]) if num else 0) - np.repeat(cu - rows, rows)
    positions = starts[req_index] + j
    is_tok = j < real[req_index]
    is_mask = ~is_tok & (j < (real + plan.masks)[req_index])
    if token_ids is None:
        tokens = np.where(is_mask, mask_id, 0)
    else:
        tok_pos = np.minimum(positions + recipe.shift, token_ids.shape[1] - 1)
        tokens = np.where(is_tok, token_ids[res.rows[req_index], tok_pos],
                          np.where(is_mask, mask_id, 0))
    # Conditioned rows read the target's hidden state at the same position: this
    # step's target pass from c on, the feature cache before c (catch-up rows).
    target_row = res.q_start[req_index] + (positions - c[req_index])
    conditioned = is_tok & recipe.conditioned
    cached = conditioned & (positions < c[req_index])
    hidden_src = np.where(conditioned & ~cached, target_row, MASK_ROW)
    read = plan.reads
    # The row whose input is the bonus token (at c + L), then `read_skip` rows on.
    read_from = (c + L - recipe.shift) - starts + recipe.read_skip
    read_req = np.repeat(np.arange(num), read)
    read_j = np.arange(int(read.sum())) - np.repeat(np.cumsum(read) - read, read)
    readout = (cu - rows)[read_req] + read_from[read_req] + read_j
    return DraftPass(recipe.name, req_index, positions, tokens.astype(np.int64),
                     hidden_src, rows, starts, readout, read, cached,
                     np.minimum(real + plan.masks, rows))


def sequential_positions(method: SpecMethod, res: StepResult, j: int) -> np.ndarray:
    """Position of each drafting request's row in one-row step j (>= 1): the j-th
    draft's position, less the recipe's shift (eagle's row at p takes the token at
    p + 1)."""
    shift = method.recipes[0].shift
    return res.computed + res.valid + j - shift
