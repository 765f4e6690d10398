"""The common case planned for the whole running set at once.

In most steps almost every running request decodes: it takes its whole pending chunk
(the last sampled token plus the s drafts waiting to be verified, 1 + s tokens) and
proposes k(s) drafts. `plan_running` computes those chunks for all running requests
with numpy and keeps the longest leading run whose rows fit every pass's budget and
whose new KV blocks fit the free pool. From the first request that does not fit, the
scheduler's per-request loop (`plan_chunk`, preemption) takes over with the budget
and pool the run left, so the two together decide exactly what the loop alone would
(tests/test_fast_path.py checks both the run against `plan_chunk` and whole
schedulers with and without it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain

import numpy as np

from scheduler.budget import ChunkPlan, ThrottleRule, k_rule_array
from scheduler.kv_cache_manager import KVCacheBlock, cdiv
from scheduler.request import Request

# Counters gathered per running request, in this order (`RunningState.gather`).
_FIELDS = 6


@dataclass(frozen=True)
class RunningState:
    """A snapshot of the counters the plan reads, one entry per running request."""

    num_computed: np.ndarray  # [num_reqs]
    num_tokens: np.ndarray  # [num_reqs] known: prompt + outputs
    num_spec: np.ndarray  # [num_reqs] drafts waiting to be verified
    num_output: np.ndarray  # [num_reqs]
    max_tokens: np.ndarray  # [num_reqs]
    num_blocks: np.ndarray  # [num_reqs] KV blocks held

    @classmethod
    def gather(cls, requests: Sequence[Request],
               req_blocks: dict[str, list[KVCacheBlock]]) -> RunningState:
        # One flat pass over the requests (one fromiter, no per-request arrays); the
        # reshape turns [c0, t0, s0, o0, m0, b0, c1, ...] into one row per request.
        flat = np.fromiter(chain.from_iterable(
            (r.num_computed_tokens, len(r.all_token_ids), len(r.spec_token_ids),
             len(r.output_token_ids), r.sampling_params.max_tokens,
             len(req_blocks.get(r.request_id, ()))) for r in requests),
            dtype=np.int64, count=_FIELDS * len(requests))
        return cls(*flat.reshape(len(requests), _FIELDS).T)


@dataclass(frozen=True)
class RunPlan:
    """Chunks for the first `count` running requests, each what `plan_chunk` returns."""

    requests: list[Request]  # [count]
    num_computed: np.ndarray  # [count] before the step
    num_tokens: np.ndarray  # [count] n
    num_spec: np.ndarray  # [count] s, drafts verified
    num_drafts: np.ndarray  # [count] k, drafts proposed
    rows: np.ndarray  # [count, num_passes]
    lookahead: np.ndarray  # [count]
    new_blocks: np.ndarray  # [count] KV blocks each must be given
    held_blocks: np.ndarray  # [count] KV blocks each held before the step

    @property
    def count(self) -> int:
        return len(self.requests)

    @cached_property  # read by the budget and by the output: summed once
    def total_rows(self) -> list[int]:
        return self.rows.sum(axis=0).tolist()

    def chunk_plans(self) -> dict[str, ChunkPlan]:
        """The same plans one by one (a refund inside the run needs them)."""
        return {
            request.request_id: ChunkPlan(n, s, k, tuple(rows), look, k)
            for request, n, s, k, rows, look in zip(
                self.requests, self.num_tokens.tolist(), self.num_spec.tolist(),
                self.num_drafts.tolist(), self.rows.tolist(), self.lookahead.tolist())
        }


class RunningPlanner:
    """Plans the leading run for one rule; built once per scheduler."""

    def __init__(self, rule: ThrottleRule, tables: tuple[np.ndarray, np.ndarray, np.ndarray],
                 block_size: int, long_prefill_threshold: int) -> None:
        self.rule = rule
        self.ctx, self.base, self.lookahead = tables
        self.block_size = block_size
        # 0: a running request's chunk is never capped (DESIGN.md's max_chunk).
        self.threshold = long_prefill_threshold

    @classmethod
    def for_rule(cls, rule: ThrottleRule, block_size: int,
                 long_prefill_threshold: int) -> RunningPlanner | None:
        tables = rule.row_tables()
        return None if tables is None else cls(rule, tables, block_size,
                                               long_prefill_threshold)

    def plan_running(self, requests: Sequence[Request], state: RunningState,
                     remaining: list[int], num_free_blocks: int) -> RunPlan:
        """The longest leading run of `requests` whose whole pending chunks fit.

        A request's chunk with an unlimited budget is its whole pending chunk, capped
        by the long-prefill threshold: n = min(first + s_held, threshold), where
        `first` counts the known tokens not yet computed. It samples if n >= first
        (verifying s = n - first drafts and proposing k(s)); otherwise it is a prefill
        piece with s = k = 0. `plan_chunk` returns exactly that chunk whenever its rows
        fit what is left, so the run is every request up to the first whose rows, or
        whose new KV blocks, overflow what the ones before it left.
        """
        first = state.num_tokens - state.num_computed
        n = first + state.num_spec
        if self.threshold > 0:
            n = np.minimum(n, self.threshold)
        samples = n >= first
        s = np.where(samples, n - first, 0)
        k = np.where(samples, k_rule_array(self.rule.max_k, self.rule.max_model_len,
                                           state.num_tokens, state.num_output,
                                           state.max_tokens, s), 0)
        rows = n[:, None] * self.ctx + self.base[k]  # [num_reqs, num_passes]
        lookahead = self.lookahead[k]
        # Blocks needed for every computed slot after the step, past those held.
        needed = cdiv(state.num_computed + n + lookahead, self.block_size)
        new_blocks = np.maximum(needed - state.num_blocks, 0)
        over_rows = (np.cumsum(rows, axis=0) > np.asarray(remaining)).any(axis=1)
        over_kv = np.cumsum(new_blocks) > num_free_blocks
        stop = np.flatnonzero(over_rows | over_kv)
        count = int(stop[0]) if len(stop) else len(requests)
        return RunPlan(list(requests[:count]), state.num_computed[:count], n[:count],
                       s[:count], k[:count], rows[:count], lookahead[:count],
                       new_blocks[:count], state.num_blocks[:count])
