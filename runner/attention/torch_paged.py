"""Paged attention in plain torch: the CPU runtime path and the Triton kernel's reference.

Short queries (decodes, verification rows, short chunks: at most `BATCHED_MAX_QUERY`
rows per request) run together as one padded pair of batched matmuls; a longer prefill
chunk runs the same computation as a call of its own, where padding every request to
the longest chunk would cost more than the calls.

Both are shaped so that a query row's output does not depend on what else shares the
pass, nor on how its prompt was cut into chunks (speculative decoding's greedy output
must equal plain decoding's; a verification pass holds more rows than a decode; and the
budget the drafts take moves where a prompt's chunks end, so a position computed in a
long chunk with speculation off may be computed in a short one with it on). Measured with
this machine's BLAS (`tests/runner/test_attention.py` checks it on every run), a row's
result is bitwise the same whatever the number of query rows, requests and key padding,
provided that:

- every matmul has at least `MIN_GEMM_ROWS` rows (fewer take a matrix-vector kernel
  that sums in another order): a lone decode row is padded to two queries, six rows
  with SmolLM2's three query heads per KV head;
- keys are padded to a multiple of `KEY_CHUNK`, and the probabilities-times-values
  product sums over them one chunk at a time in order (one matmul per chunk, then
  a sum over chunks): the BLAS splits a longer sum at points that move with its
  length (from 193 keys on, here), so a row would change with the longest request
  beside it; masked keys add exact zeros;
- there are at least `MIN_PROBLEMS` matmuls in the batch (a lone one is split across
  threads, in another order);
- scores, softmax and the weighted sum run in float32 whatever the model's dtype.

A long chunk once ran torch's fused scaled-dot-product attention instead, which sums in
an order of its own: in bfloat16 a prompt's last rows then differed (by up to 0.2 in a
logit) between a prompt prefilled whole and one whose last chunk was short, and greedy
outputs with speculation on parted from speculation off's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.attention.backend import AttentionBackend, write_kv
from runner.attention.metadata import AttentionMetadata
from scheduler.kv_cache_manager import cdiv

BATCHED_MAX_QUERY = 32
MIN_GEMM_ROWS = 4
KEY_CHUNK = 128
MIN_PROBLEMS = 2


@dataclass(frozen=True)
class BatchedPlan:
    """Index tensors of one step's padded call: the same for every layer.

    R requests, each padded to Q query rows and L keys; G = query heads per KV head.
    The matmuls run over R * num_kv_heads problems of Q * G rows each.
    """

    reqs: set[int]  # scheduled-request indices served by the padded call
    shape: tuple[int, int, int, int]  # (R, Hkv, Q, G)
    q_index: torch.Tensor  # [R*Hkv*Q*G] row of query.view(-1, D) (padding repeats a real row)
    kv_index: torch.Tensor  # [R*Hkv*L] row of cache.view(-1, D) (position 0 past the end)
    mask: torch.Tensor  # [R*Hkv, Q*G, L] float32: 0 where the query sees the key, else -inf
    out_index: torch.Tensor  # row of out.view(-1, D) of each real padded query row
    real: torch.Tensor  # [R*Hkv*Q*G] bool: which padded query rows are real
    # When every request is in the plan: the padded row of each out row, in order.
    gather_out: torch.Tensor | None


class TorchPagedAttention(AttentionBackend):
    """Short queries batched into one call; long chunks one call per request."""

    name = "torch"

    def __init__(self) -> None:
        # The plans for the last metadata seen: every layer of a step shares them.
        # Runners build a fresh AttentionMetadata per pass and never change one, so
        # identity is the right key (the held reference keeps its id from being reused).
        self._plans: tuple[AttentionMetadata, tuple[int, ...], list[BatchedPlan]] | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_tokens = meta.num_actual_tokens
        write_kv(key[:num_tokens], value[:num_tokens], key_cache, value_cache,
                 meta.slot_mapping[:num_tokens])
        out = torch.empty_like(query[:num_tokens])
        shape = (key_cache.shape[1], query.shape[1], key_cache.shape[2])
        for plan in self._split(meta, shape):
            out = _attend_batched(query, key_cache, value_cache, plan, scale, out)
        return out

    def _split(self, meta: AttentionMetadata, shape: tuple[int, int, int]
               ) -> list[BatchedPlan]:
        """One plan for the short queries, one for each long chunk."""
        if self._plans is None or self._plans[0] is not meta or self._plans[1] != shape:
            starts = meta.query_start_loc_cpu
            short = [i for i in range(meta.num_reqs)
                     if starts[i + 1] - starts[i] <= BATCHED_MAX_QUERY]
            long = [[i] for i in range(meta.num_reqs)
                    if starts[i + 1] - starts[i] > BATCHED_MAX_QUERY]
            self._plans = (meta, shape, [plan_batched(meta, reqs, *shape)
                                         for reqs in ([short] if short else []) + long])
        return self._plans[2]


def plan_batched(meta: AttentionMetadata, reqs: list[int], block_size: int,
                 num_heads: int, num_kv_heads: int) -> BatchedPlan:
    """The padded call for these requests (scheduled-request indices, at least one).

    Padding query rows repeat the request's last row (their output is dropped), and
    padding key slots point at the request's position 0 (always masked), so nothing
    outside the request's own cache is ever read, not even stale NaNs.
    """
    starts_cpu = meta.query_start_loc_cpu
    group = num_heads // num_kv_heads
    device = meta.query_start_loc.device
    # Too few matmuls: repeat the first request (its copies' rows are dropped).
    copies = max(0, cdiv(MIN_PROBLEMS, num_kv_heads) - len(reqs))
    index = torch.tensor(reqs + [reqs[0]] * copies, dtype=torch.long, device=device)
    starts = meta.query_start_loc[index].long()
    num_q = meta.query_start_loc[index + 1].long() - starts
    seq_lens = meta.seq_lens[index].long()
    max_q = max(max(starts_cpu[i + 1] - starts_cpu[i] for i in reqs),
                cdiv(MIN_GEMM_ROWS, group))
    max_len = max(meta.seq_lens_cpu[i] for i in reqs)
    max_len = cdiv(max_len, KEY_CHUNK) * KEY_CHUNK
    j = torch.arange(max_q, device=device)
    last = torch.minimum(j[None, :], num_q[:, None] - 1)  # [R, Q]
    rows = starts[:, None] + last
    t = torch.arange(max_len, device=device)
    t_in = torch.where(t[None, :] < seq_lens[:, None], t[None, :], 0)  # [R, L]
    blocks = meta.block_table[index[:, None], t_in // block_size].long()
    q_pos = seq_lens[:, None] - num_q[:, None] + last  # [R, Q]
    seen = t[None, None, :] <= q_pos[:, :, None]  # [R, Q, L]
    mask = torch.zeros(seen.shape, dtype=torch.float32, device=device)
    mask.masked_fill_(~seen, float("-inf"))
    slots = blocks * block_size + t_in % block_size  # [R, L]
    kv_heads = torch.arange(num_kv_heads, device=device)
    heads = kv_heads[:, None] * group + torch.arange(group, device=device)[None, :]  # [Hkv, G]
    shape = (len(index), num_kv_heads, max_q, group)
    q_index = (rows[:, None, :, None] * num_heads + heads[None, :, None, :]).expand(shape)
    real_q = (j[None, :] < num_q[:, None]) & (torch.arange(len(index), device=device)
                                              < len(reqs))[:, None]
    real = real_q[:, None, :, None].expand(shape).reshape(-1)
    out_index = q_index.reshape(-1)[real]
    gather_out = None
    if len(reqs) == meta.num_reqs:
        gather_out = torch.empty_like(out_index)
        gather_out[out_index] = torch.nonzero(real).flatten()
    # Expanded once per step, so each layer adds it inside its score matmul (baddbmm).
    problem_mask = mask[:, None, :, None, :].expand(*shape, max_len).reshape(
        len(index) * num_kv_heads, max_q * group, max_len)
    return BatchedPlan(set(reqs), shape, q_index.reshape(-1),
                       (slots[:, None, :] * num_kv_heads + kv_heads[None, :, None]).reshape(-1),
                       problem_mask, out_index, real, gather_out)


def _attend_batched(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    plan: BatchedPlan, scale: float, out: torch.Tensor) -> torch.Tensor:
    """The plan's requests in one pair of float32 batched matmuls; returns `out`, or a
    new tensor in its place when the plan covers every row."""
    num_reqs, num_kv_heads, max_q, group = plan.shape
    head_dim = key_cache.shape[-1]
    problems = num_reqs * num_kv_heads
    q = query.reshape(-1, head_dim).index_select(0, plan.q_index)
    k = key_cache.view(-1, head_dim).index_select(0, plan.kv_index)
    v = value_cache.view(-1, head_dim).index_select(0, plan.kv_index)
    if q.dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    k = k.view(problems, -1, head_dim)
    num_keys = k.shape[1]
    scores = torch.baddbmm(plan.mask, q.view(problems, max_q * group, head_dim),
                           k.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1)
    chunks = num_keys // KEY_CHUNK
    probs = probs.view(problems, max_q * group, chunks, KEY_CHUNK).transpose(1, 2)
    parts = torch.bmm(probs.reshape(problems * chunks, max_q * group, KEY_CHUNK),
                      v.view(problems * chunks, KEY_CHUNK, head_dim))
    attn = parts.view(problems, chunks, -1).sum(1).view(-1, head_dim)
    if plan.gather_out is not None:
        return attn.index_select(0, plan.gather_out).view(out.shape).to(out.dtype)
    out.view(-1, head_dim).index_copy_(0, plan.out_index, attn[plan.real].to(out.dtype))
    return out
