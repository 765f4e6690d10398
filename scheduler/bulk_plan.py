"""The bulk plan: the common case decided for the whole running set at once.

In most steps almost every running request decodes: it takes its whole pending chunk
(the last sampled token plus the s drafts waiting to be verified, 1 + s tokens) and
proposes k(s) drafts. `plan_bulk` computes those chunks for all running requests with
numpy, from the rule's own tables and k rule (`ThrottleRule.tables`, `.k`), and charges
the longest leading run whose rows fit every pass's budget and whose new KV blocks fit
the free pool to the step record. From the first request that does not fit, the
scheduler's per-request loop (`plan_chunk`, preemption) takes over with the budget and
pool the bulk plan left, so the two together decide exactly what the loop alone would
(tests/scheduler/test_bulk_plan.py checks both the bulk rows against `plan_chunk` and
whole schedulers with and without the bulk plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from scheduler.kv_cache_manager import KVCacheBlock, cdiv
from scheduler.request import NUM_OUTCOMES, Request
from scheduler.step_record import StepRecord
from spec_decode.methods import context_rows

# Counters gathered per running request (`RunningCounters.gather`): ten, then the
# verifications per state.
_FIELDS = 10 + NUM_OUTCOMES


@dataclass(frozen=True)
class RunningCounters:
    """A snapshot of the counters the bulk plan reads, one entry per running request."""

    num_computed: np.ndarray  # [num_reqs]
    num_tokens: np.ndarray  # [num_reqs] known: prompt + outputs
    num_spec: np.ndarray  # [num_reqs] drafts waiting to be verified
    num_output: np.ndarray  # [num_reqs]
    max_tokens: np.ndarray  # [num_reqs]
    num_blocks: np.ndarray  # [num_reqs] KV blocks held
    num_drafter_computed: np.ndarray  # [num_reqs] positions its drafter holds (<= computed)
    # For the goodput policy:
    first_accepted: np.ndarray  # [num_reqs] verifications that accepted the first draft
    last_outcome: np.ndarray  # [num_reqs] the state its last verification left
    last_verified: np.ndarray  # [num_reqs] its output tokens at that verification
    verifications: np.ndarray  # [num_reqs, NUM_OUTCOMES] so far, per state it was in

    @classmethod
    def gather(cls, requests: Sequence[Request],
               req_blocks: dict[str, list[KVCacheBlock]]) -> RunningCounters:
        # One flat pass over the requests (one fromiter, no per-request arrays); the
        # reshape turns [c0, t0, s0, o0, m0, b0, w0, a0, l0, lv0, v0..., c1, ...] into one
        # row each.
        flat = np.fromiter(chain.from_iterable(
            (r.num_computed_tokens, len(r.all_token_ids), len(r.spec_token_ids),
             len(r.output_token_ids), r.sampling_params.max_tokens,
             len(req_blocks.get(r.request_id, ())), r.num_drafter_computed,
             r.num_first_accepted, r.last_outcome, r.last_verified_output,
             *r.verifications_by_state)
            for r in requests),
            dtype=np.int64, count=_FIELDS * len(requests))
        rows = flat.reshape(len(requests), _FIELDS)
        c, t, s, o, m, b, w, a, last, lv = rows[:, :10].T
        return cls(c, t, s, o, m, b, w, a, last, lv, rows[:, 10:])

    @property
    def behind(self) -> np.ndarray:
        """[num_reqs] rows each request's drafter skipped while parked."""
        return self.num_computed - self.num_drafter_computed

    @property
    def unverified(self) -> np.ndarray:
        """[num_reqs] output tokens each made since its last verification."""
        return self.num_output - self.last_verified


def plan_bulk(record: StepRecord, requests: Sequence[Request], counters: RunningCounters,
              num_free_blocks: int, block_size: int, long_prefill_threshold: int,
              max_drafts: np.ndarray | None = None) -> int:
    """Charge `record` with the longest leading run of `requests` whose whole pending
    chunks fit; return how many. The rule must be tabled (`record.rule.tables`);
    `max_drafts` caps each request's k below the rule's (the draft policy's caps).

    A request's chunk with an unlimited budget is its whole pending chunk, capped by
    the long-prefill threshold (0: never capped): n = min(first + s_held, threshold),
    where `first` counts the known tokens not yet computed. It samples if n >= first
    (verifying s = n - first drafts and proposing k(s)); otherwise it is a prefill
    piece with s = k = 0. Its context rows are `context_rows` (parked, or caught
    up). `plan_chunk` returns exactly that chunk whenever its rows fit what is left,
    so the run is every request up to the first whose rows, or whose new KV blocks,
    overflow what the ones before it left.
    """
    rule = record.rule
    assert rule.tables is not None, "the bulk plan needs a tabled rule"
    ctx, base, lookahead_of = rule.tables
    c = counters
    first = c.num_tokens - c.num_computed
    n = first + c.num_spec
    if long_prefill_threshold > 0:
        n = np.minimum(n, long_prefill_threshold)
    samples = n >= first
    s = np.where(samples, n - first, 0)
    if max_drafts is not None and not max_drafts.any():
        k = np.zeros_like(s)  # nobody drafts (a held plan): the rule's k cannot matter
    else:
        k = rule.k(c.num_tokens, c.num_output, c.max_tokens, s)
        if max_drafts is not None:
            k = np.minimum(k, max_drafts)
        k = np.where(samples, k, 0)
    # Context passes take each request's context rows (parked: 0; behind: n + b), the
    # target pass n.
    context = context_rows(rule.parks, n, k, c.behind, samples)
    rows = context[:, None] * ctx + base[k]  # [num_reqs, num_passes]
    rows[:, 0] = n * ctx[0] + base[k, 0]
    lookahead = lookahead_of[k]
    # Blocks needed for every computed slot after the step, past those held.
    needed = cdiv(c.num_computed + n + lookahead, block_size)
    new_blocks = np.maximum(needed - c.num_blocks, 0)
    over_rows = (np.cumsum(rows, axis=0) > np.asarray(record.remaining)).any(axis=1)
    over_kv = np.cumsum(new_blocks) > num_free_blocks
    stop = np.flatnonzero(over_rows | over_kv)
    count = int(stop[0]) if len(stop) else len(requests)
    if count:
        record.extend(list(requests[:count]), c.num_computed[:count], n[:count], s[:count],
                      k[:count], rows[:count], lookahead[:count], c.num_blocks[:count],
                      new_blocks[:count], samples[:count])
    return count
