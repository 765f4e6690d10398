"""The throttle: per-pass budgets and the largest chunk a request may take.

Pure decisions (`k_rule`, `plan_chunk`, and `ThrottleRule.tables`, which the bulk plan
reads) are separate from the one mutable store of a step (`StepRecord`,
step_record.py), so a policy can be computed and tested without touching state.

One step runs the target pass and each drafter pass of the method; every one starts
with B = max_num_batched_tokens rows. A request scheduled with n tokens that proposes
k drafts puts n rows in the target pass and `method.rows(n, k, context)` in the
drafter's (the method's cost table, spec_decode/methods/), where `context` is n, or,
under a method that parks, 0 for a sampling chunk with k = 0 and n + b for a request
that drafts b rows behind (`context_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from spec_decode import SpecMethod, SpeculativeConfig, min_decode_rows
from spec_decode.methods import context_rows
from spec_decode.tree_shape import TreeShape


@dataclass(frozen=True)
class ChunkPlan:
    """One request's share of the step: n tokens, s drafts verified, k proposed."""

    num_tokens: int
    num_spec: int
    num_draft_tokens: int  # k
    rows: tuple[int, ...]  # per pass: target first, then the drafter's passes
    lookahead: int
    # k the rule allowed; above num_draft_tokens only when the adaptive policy cut k to fit.
    rule_draft_tokens: int = 0
    samples: bool = True  # the chunk reaches the last known token


Counts = int | np.ndarray  # one request's counter, or one per request


@dataclass(frozen=True)
class RequestView:
    """The counters of a request that the throttle reads (a snapshot, never mutated)."""

    num_computed_tokens: int
    num_tokens: int  # known: prompt + outputs
    num_spec_tokens: int  # drafts waiting to be verified
    num_output_tokens: int
    max_tokens: int
    max_drafts: int = 1 << 30  # the draft policy's cap on k (goodput); the rule's k below it
    num_drafter_computed: int | None = None  # positions its drafter holds; None: all computed

    @property
    def behind(self) -> int:
        """Rows its drafter skipped while parked, caught up when it drafts."""
        if self.num_drafter_computed is None:
            return 0
        return self.num_computed_tokens - self.num_drafter_computed


def k_rule(max_k: int, max_model_len: int, num_tokens: Counts, num_output: Counts,
           max_tokens: Counts, num_spec: Counts) -> np.ndarray:
    """k for requests that sample this step after verifying `num_spec` (s) drafts.

    Takes one request's counters or arrays of many (the bulk plan): one rule, so the
    two deciders cannot drift apart. Both cuts take the worst case: this step emits up
    to s + 1 tokens and the next step up to k + 1 (its k drafts all accepted, plus a
    bonus token). So after two steps the request holds at most `max_model_len` tokens
    and has emitted at most `max_tokens`: no draft is proposed that could not be used,
    and no position at or past `max_model_len` is ever written (DESIGN.md §2).
    """
    room = np.minimum(max_model_len - (num_tokens + num_spec + 2),
                      max_tokens - (num_output + num_spec) - 2)
    return np.clip(room, 0, max_k)


class ThrottleRule:
    """Rows charged per pass for a chunk; swapped for vLLM's rules in benchmarks."""

    def __init__(self, method: SpecMethod | None, max_k: int, max_model_len: int,
                 adaptive: bool = False, parks: bool = True) -> None:
        self.method = method
        self.max_k = max_k if method is not None else 0
        self.max_model_len = max_model_len
        # Adaptive ("fit"): a sampling chunk whose k does not fit may propose fewer.
        self.adaptive = adaptive
        self.context = (True,) + (method.context_passes if method else ())
        self.pass_names = ("target",) + (method.pass_names if method else ())
        # A sampling chunk with k = 0 is parked (`SpeculativeConfig.parks`); False: the
        # drafter follows every chunk.
        self.parks = parks and method is not None and method.parks

    @property
    def num_passes(self) -> int:
        return len(self.context)

    def initial_budget(self, max_num_batched_tokens: int) -> list[int]:
        """Rows each pass may take in a fresh step; every pass gets all of B."""
        return [max_num_batched_tokens] * self.num_passes

    def k(self, num_tokens: Counts, num_output: Counts, max_tokens: Counts,
          num_spec: Counts) -> np.ndarray:
        """`k_rule` under this rule's K and max_model_len (scalars or arrays)."""
        return k_rule(self.max_k, self.max_model_len, num_tokens, num_output, max_tokens,
                      num_spec)

    @cached_property  # derived once per rule: a swapped rule brings its own tables
    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The cost table as arrays, for the bulk plan (scheduler/bulk_plan.py).

        (ctx [num_passes], base [max_k + 1, num_passes], lookahead [max_k + 1]): a
        chunk of n tokens proposing k drafts charges `n * ctx + base[k]` rows and holds
        `lookahead[k]` slots. Read from `plan` itself, so a rule that overrides it
        (benchmarks' vLLM rules) is tabled too; None if its rows are not of that
        form, and the scheduler then plans every request with `plan_chunk`.
        """
        ks = range(self.max_k + 1)
        # Rows of a request that follows (samples=False: never parked); the bulk plan
        # parks and adds catch-up rows itself.
        one = np.array([self.plan(1, 0, k, samples=False).rows for k in ks], dtype=np.int64)
        two = np.array([self.plan(2, 0, k, samples=False).rows for k in ks], dtype=np.int64)
        ctx = two[0] - one[0]
        if not (np.all(two - one == ctx) and np.isin(ctx, (0, 1)).all()):
            return None
        lookahead = np.array([self.plan(1, 0, k).lookahead for k in ks], dtype=np.int64)
        return ctx, one - ctx, lookahead

    def plan(self, n: int, num_spec: int, k: int, behind: int = 0,
             samples: bool = True) -> ChunkPlan:
        """The method's cost table, target pass first, for a chunk `behind` rows of
        drafter context behind that samples or not (`context_rows`)."""
        method = self.method
        if method is None:
            return ChunkPlan(n, num_spec, k, (n,), 0, k, samples=samples)
        context = context_rows(self.parks, n, k, behind, samples)
        return ChunkPlan(n, num_spec, k, (n, *method.rows(n, k, context)),
                         method.slots_ahead(k), k, samples=samples)


class TreeDepthRule(ThrottleRule):
    """A rule whose k is a drafted tree's depth (spec_decode/tree_shape.py): what the
    goodput policy prices and learns in, a depth's chance of a token and the rows its
    nodes cost, where the scheduler charges the nodes (`TreeShape.nodes`)."""

    def __init__(self, rule: ThrottleRule, shape: TreeShape) -> None:
        super().__init__(rule.method, shape.depth(rule.max_k), rule.max_model_len,
                         rule.adaptive, rule.parks)
        self.nodes_rule, self.shape = rule, shape

    def plan(self, n: int, num_spec: int, k: int, behind: int = 0,
             samples: bool = True) -> ChunkPlan:
        nodes = self.shape.nodes(k)
        verified = self.shape.nodes(num_spec)
        return self.nodes_rule.plan(n - num_spec + verified, verified, nodes, behind, samples)


def plan_chunk(rule: ThrottleRule, remaining: list[int], req: RequestView,
               max_chunk: int, allow_partial: bool) -> ChunkPlan | None:
    """The largest chunk (n <= max_chunk) whose rows fit every pass's remaining budget.

    Chunks shorter than `first` (the tokens up to and including the last known one)
    do not sample: k = 0, rows are n in the passes that carry context and 0 elsewhere.
    Chunks of `first + s` sample after verifying s drafts and propose k(s). Rows never
    shrink as n grows, so scanning down from the linear bound finds the largest fit;
    the scan covers at most the s + 1 sampling chunks. `allow_partial=False` forbids a
    chunk that stops short of sampling (whole-prompt prefill). Under the adaptive
    policy a sampling chunk tries k(s), k(s) - 1, ..., 0 before a shorter chunk:
    verifying drafts already made beats proposing new ones.
    """
    first = req.num_tokens - req.num_computed_tokens
    behind = req.behind
    # Every context pass bounds n, less the rows a following drafter catches up; a
    # sampling chunk that may park is bounded by the target pass alone.
    target = min(max_chunk, remaining[0])
    linear = min([target] + [rem - behind
                             for rem, ctx in zip(remaining[1:], rule.context[1:]) if ctx])
    for n in range(target if rule.parks else linear, first - 1, -1):
        s = n - first
        k_max = min(int(rule.k(req.num_tokens, req.num_output_tokens, req.max_tokens, s)),
                    req.max_drafts)
        for k in _ks_to_try(rule, k_max, behind):
            plan = rule.plan(n, s, k, behind)
            if _fits(plan, remaining):
                return plan if k == k_max else replace(plan, rule_draft_tokens=k_max)
    if not allow_partial:
        return None
    # A chunk that does not sample: rules that charge a fixed extra per request
    # (benchmarks' vLLM rules) may need a few tokens less than the linear bound.
    for n in range(min(linear, first - 1), 0, -1):
        plan = rule.plan(n, 0, 0, behind, samples=False)
        if _fits(plan, remaining):
            return plan
    return None


def _ks_to_try(rule: ThrottleRule, k_max: int, behind: int) -> range | tuple[int, ...]:
    """k's a sampling chunk tries, most first: all down to 0 under the adaptive policy;
    otherwise k_max, and 0 after it for a parked request whose catch-up rows do not
    fit (parked again rather than left out of the step)."""
    if rule.adaptive:
        return range(k_max, -1, -1)
    if rule.parks and behind and k_max:
        return (k_max, 0)
    return (k_max,)


def _fits(plan: ChunkPlan, remaining: list[int]) -> bool:
    return all(row <= rem for row, rem in zip(plan.rows, remaining))


def check_budget_config(rule: ThrottleRule, spec: SpeculativeConfig | None,
                        max_num_batched_tokens: int) -> None:
    """Refuse a B that cannot serve one decoding request verifying and proposing K.

    Checked against the rule's own starting budget, so a swapped-in rule that
    reserves rows up front (benchmarks' vLLM rules) is refused too, not left to
    admit nothing forever.
    """
    max_k, budget = rule.max_k, max_num_batched_tokens
    names = rule.pass_names
    rows = rule.plan(1 + max_k, max_k, max_k).rows
    for name, need, have in zip(names, rows, rule.initial_budget(budget)):
        if need <= have:
            continue
        method = spec.method if spec else "none"
        need_all = min_decode_rows(spec) if spec else {"target": 1}
        raise ValueError(
            f"max_num_batched_tokens={budget} is below one decoding request's cost "
            f"under method={method!r} with num_speculative_tokens={max_k}: its "
            f"{name!r} pass needs {need} rows but gets {have} (all passes: {need_all}); "
            f"set max_num_batched_tokens >= {max(need_all.values()) + budget - have}"
        )
