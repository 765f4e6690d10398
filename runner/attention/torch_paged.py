"""Paged attention in plain torch: the CPU runtime path and the Triton kernel's reference.

Short queries (decodes and verification rows: at most `BATCHED_MAX_QUERY` rows per
request), when there are at least `BATCHED_MIN_REQUESTS` of them, run as one padded
scaled-dot-product call, because a Python loop over requests costs more than the
attention itself once a few dozen requests decode together; longer prefill chunks run
one call per request, where padding every request to the longest chunk would cost
more than the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runner.attention.backend import AttentionBackend, write_kv
from runner.attention.metadata import AttentionMetadata

BATCHED_MAX_QUERY = 16
# The padded call's fixed cost (index building, ~0.6 ms here) is about two per-request
# calls (~0.35 ms each), so one or two short requests keep the loop.
BATCHED_MIN_REQUESTS = 3


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One request's first `seq_len` K or V rows: [seq_len, num_kv_heads, head_dim]."""
    return cache[block_ids].flatten(0, 1)[:seq_len]


@dataclass(frozen=True)
class BatchedPlan:
    """Index tensors of one step's padded call: the same for every layer."""

    reqs: set[int]  # scheduled-request indices served by the padded call
    rows: torch.Tensor  # [R, Q] query row of each padded query (the last real one repeated)
    slots: torch.Tensor  # [R, L] cache slot of each key position (position 0 past the end)
    mask: torch.Tensor  # [R, 1, Q, L] causal and length mask
    real_rows: torch.Tensor  # the real query rows, in the order of `real`
    real: torch.Tensor  # [R, Q] which padded queries are real


class TorchPagedAttention(AttentionBackend):
    """Short queries batched into one call; long chunks one call per request."""

    name = "torch"

    def __init__(self) -> None:
        # The plan for the last metadata seen: every layer of a step shares it. Runners
        # build a fresh AttentionMetadata per pass and never change one, so identity
        # is the right key (the held reference keeps its id from being reused).
        self._plan: tuple[AttentionMetadata, int, BatchedPlan | None, list[int]] | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_tokens = meta.num_actual_tokens
        write_kv(key[:num_tokens], value[:num_tokens], key_cache, value_cache,
                 meta.slot_mapping[:num_tokens])
        out = torch.empty_like(query[:num_tokens])
        plan, alone = self._split(meta, key_cache.shape[1])
        if plan is not None:
            _attend_batched(query, key_cache, value_cache, plan, scale, out)
        for i in alone:
            _attend_one(query, key_cache, value_cache, meta, scale, i, out)
        return out

    def _split(self, meta: AttentionMetadata, block_size: int
               ) -> tuple[BatchedPlan | None, list[int]]:
        """The padded call's plan and the requests that run one call each."""
        if self._plan is None or self._plan[0] is not meta or self._plan[1] != block_size:
            plan = plan_batched(meta, block_size)
            alone = [i for i in range(meta.num_reqs) if plan is None or i not in plan.reqs]
            self._plan = (meta, block_size, plan, alone)
        return self._plan[2], self._plan[3]


def _attend_one(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, i: int, out: torch.Tensor) -> None:
    """Request i alone over its gathered cache blocks."""
    q_start, q_end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
    seq_len = meta.seq_lens_cpu[i]
    block_size = key_cache.shape[1]
    blocks = meta.block_table[i, :-(-seq_len // block_size)].long()
    k = gather_kv(key_cache, blocks, seq_len)
    v = gather_kv(value_cache, blocks, seq_len)
    q = query[q_start:q_end]
    # Query j sits at position seq_len - num_q + j: it sees keys 0..that position.
    num_q = q_end - q_start
    q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
        scale=scale, enable_gqa=True)
    out[q_start:q_end] = attn.transpose(0, 1)


def plan_batched(meta: AttentionMetadata, block_size: int) -> BatchedPlan | None:
    """The padded call for this step's short queries, or None when there are too few.

    Padding query rows repeat the request's last row (their output is dropped), and
    padding key slots point at the request's position 0 (always masked), so nothing
    outside the request's own cache is ever read, not even stale NaNs.
    """
    starts_cpu = meta.query_start_loc_cpu
    reqs = [i for i in range(meta.num_reqs)
            if starts_cpu[i + 1] - starts_cpu[i] <= BATCHED_MAX_QUERY]
    if len(reqs) < BATCHED_MIN_REQUESTS:
        return None
    device = meta.query_start_loc.device
    index = torch.tensor(reqs, dtype=torch.long, device=device)
    starts = meta.query_start_loc[index].long()
    num_q = meta.query_start_loc[index + 1].long() - starts
    seq_lens = meta.seq_lens[index].long()
    max_q = max(starts_cpu[i + 1] - starts_cpu[i] for i in reqs)
    max_len = max(meta.seq_lens_cpu[i] for i in reqs)
    j = torch.arange(max_q, device=device)
    last = torch.minimum(j[None, :], num_q[:, None] - 1)  # [R, Q]
    rows = starts[:, None] + last
    t = torch.arange(max_len, device=device)
    t_in = torch.where(t[None, :] < seq_lens[:, None], t[None, :], 0)  # [R, L]
    blocks = meta.block_table[index[:, None], t_in // block_size].long()
    q_pos = seq_lens[:, None] - num_q[:, None] + last
    real = j[None, :] < num_q[:, None]
    return BatchedPlan(set(reqs), rows, blocks * block_size + t_in % block_size,
                       (t[None, None, :] <= q_pos[:, :, None])[:, None], rows[real], real)


def _attend_batched(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    plan: BatchedPlan, scale: float, out: torch.Tensor) -> None:
    """The plan's requests in one call, each padded to the longest query and sequence."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    k = key_cache.view(-1, num_kv_heads, head_dim)[plan.slots].transpose(1, 2)  # [R, Hk, L, D]
    v = value_cache.view(-1, num_kv_heads, head_dim)[plan.slots].transpose(1, 2)
    q = query[plan.rows].transpose(1, 2)  # [R, H, Q, D]
    attn = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale,
                                          enable_gqa=True).transpose(1, 2)  # [R, Q, H, D]
    out[plan.real_rows] = attn[plan.real]
