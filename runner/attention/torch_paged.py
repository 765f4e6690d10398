"""Paged attention in plain torch: the CPU runtime path and the Triton kernel's reference.

Short queries (decodes, verification rows, short chunks: at most `BATCHED_MAX_QUERY`
rows per request) run as padded pairs of batched matmuls, a few requests of like length
per call (`SHORT_CALL_KEYS`); a longer prefill chunk runs the same computation in calls
of its own, its rows cut into tiles of `LONG_TILE` and the tiles grouped so a call's
scores stay under `MAX_CALL_SCORES` (a long prompt's memory is bounded, and its early
tiles skip the keys they cannot see), where padding every request to the longest chunk
would cost more than the calls.

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
an order of its own: in bfloat16 a prompt's last rows then differed (by up to 0.375 in a
logit) between a prompt prefilled whole and one whose last chunk was short, and greedy
outputs with speculation on parted from speculation off's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from runner.attention.backend import AttentionBackend
from runner.attention.metadata import AttentionMetadata
from scheduler.kv_cache_manager import cdiv

BATCHED_MAX_QUERY = 32
MIN_GEMM_ROWS = 4
KEY_CHUNK = 128
MIN_PROBLEMS = 2
LONG_TILE = 64
# A short call's padded request-keys at most (`_by_keys`). One call for every short
# query padded them all to the longest, and past a few thousand request-keys a call's
# float32 keys and values (768 B a request-key with SmolLM2's three KV heads) outgrow
# the caches, so each key costs more: one call's attention for a layer, decode rows of
# the default model, 128 keys each: 8 requests 171 us, 32 612 us, 64 2,230 us; 256 keys:
# 8 301 us, 64 6,283 us (a call's fixed cost ~90 us). Measured in place, speculation
# off, greedy chat of 64 tokens: 16 running 164-194 -> 206-244 tok/s, 64 running
# 260-280 -> 287-328; training data (`train-drafter`, 64 at once) 95-159 -> 239-317
# answer tokens/s, outputs unchanged. 1,024 beat 512, 2,048 and 4,096 there.
SHORT_CALL_KEYS = 1024
MAX_CALL_SCORES = 1 << 23  # float32 scores of one long-chunk call: 32 MiB
# Long calls' expanded masks held for the whole step, up to this many bytes in all;
# past it a call expands its own each layer, one more pass over its scores. Held, a
# 256-row chunk's attention costs 0.98-1.13x what fused SDPA did over 256-2,048 keys
# (a diagnostic timing, interleaved medians of 21 calls each).
MAX_HELD_MASK_BYTES = 1 << 26

# Rows of one request that a call serves as one padded "request": (request index, its
# first query row, rows, keys it sees through its last row, and -1; or, for a tree row
# alone, its own key's position: its keys are then the first `keys - 1` and its own,
# in that order, so it computes exactly what it would at position `keys - 1`).
Slice = tuple[int, int, int, int, int]


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
    hidden: torch.Tensor  # [R, Q, L] bool: the keys each padded query row may not see
    # [R*Hkv, Q*G, L] float32, 0 where the query sees the key, else -inf: expanded once
    # per step (every layer adds it inside its score matmul); None for a long chunk's
    # call past MAX_HELD_MASK_BYTES, whose mask is expanded per call from `hidden`.
    mask: torch.Tensor | None
    out_index: torch.Tensor  # row of out.view(-1, D) of each real padded query row
    real: torch.Tensor  # [R*Hkv*Q*G] bool: which padded query rows are real
    # When the plan serves every row of the pass: the padded row of each out row.
    gather_out: torch.Tensor | None


class TorchPagedAttention(AttentionBackend):
    """Short queries batched into one call; a long chunk's tiles in calls of their own."""

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
        self.write(key, value, key_cache, value_cache, meta)
        out = torch.empty_like(query[:num_tokens])
        shape = (key_cache.shape[1], query.shape[1], key_cache.shape[2])
        for plan in self._split(meta, shape):
            out = _attend_batched(query, key_cache, value_cache, plan, scale, out)
        return out

    def _split(self, meta: AttentionMetadata, shape: tuple[int, int, int]
               ) -> list[BatchedPlan]:
        """One plan for the short queries, then a long chunk's tiles in groups."""
        if self._plans is None or self._plans[0] is not meta or self._plans[1] != shape:
            short, long = _slices(meta)
            # The short calls always hold their masks (the decode path); long calls
            # while their masks fit in MAX_HELD_MASK_BYTES.
            plans = [_holding_mask(plan_batched(meta, group, *shape))
                     for group in _by_keys(short)]
            room = MAX_HELD_MASK_BYTES
            for tiles in _group_tiles(long, heads=shape[1]):
                plan = plan_batched(meta, tiles, *shape)
                size = 4 * math.prod(plan.shape) * plan.hidden.shape[-1]
                if size <= room:
                    plan, room = _holding_mask(plan), room - size
                plans.append(plan)
            self._plans = (meta, shape, plans)
        return self._plans[2]


def _slices(meta: AttentionMetadata) -> tuple[list[Slice], list[list[Slice]]]:
    """The short requests whole, and each long chunk cut into tiles of `LONG_TILE`
    rows (a tile sees the keys through its own last row)."""
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    short: list[Slice] = []
    long: list[list[Slice]] = []
    for i in range(meta.num_reqs):
        first, rows, seq_len = starts[i], starts[i + 1] - starts[i], seq_lens[i]
        if meta.tree_prefix_cpu is not None:
            short += _tree_slices(meta.tree_prefix_cpu, i, first, rows, seq_len)
            tree = int((meta.tree_prefix_cpu[first:first + rows] >= 0).sum())
            rows, seq_len = rows - tree, seq_len - tree  # tree rows end a request's rows
        if rows <= BATCHED_MAX_QUERY:
            if rows:
                short.append((i, first, rows, seq_len, -1))
            continue
        long.append([(i, first + t, min(LONG_TILE, rows - t),
                      seq_len - rows + t + min(LONG_TILE, rows - t), -1)
                     for t in range(0, rows, LONG_TILE)])
    return short, long


def _tree_slices(tree_prefix: np.ndarray, req: int, first: int, rows: int, seq_len: int
                 ) -> list[Slice]:
    """Each tree row of a request as a slice of its own (see `Slice`)."""
    own = np.flatnonzero(tree_prefix[first:first + rows] >= 0)
    if len(own) and own[0] + len(own) != rows:
        raise ValueError("attention metadata: a request's tree rows must be its last rows")
    slices: list[Slice] = []
    for j in own.tolist():
        prefix, position = int(tree_prefix[first + j]), seq_len - rows + j
        if not 1 <= prefix <= position:
            raise ValueError(f"attention metadata: a tree row's prefix must lie in [1, its "
                             f"own position {position}], got {prefix}")
        slices.append((req, first + j, 1, prefix + 1, position))
    return slices


def _by_keys(short: list[Slice]) -> list[list[Slice]]:
    """The short slices in calls of at most `SHORT_CALL_KEYS` padded request-keys each
    (at least one request), sorted by the keys they see: each call pads its requests
    to its own longest, so one long request does not pad every decode beside it, and a
    call's float32 keys and values stay in the caches. A row's result does not depend
    on the call it is in (the module docstring)."""
    calls: list[list[Slice]] = []
    current: list[Slice] = []
    for piece in sorted(short, key=lambda piece: piece[3]):
        keys = cdiv(piece[3], KEY_CHUNK) * KEY_CHUNK  # sorted: the call's longest
        if current and (len(current) + 1) * keys > SHORT_CALL_KEYS:
            calls.append(current)
            current = []
        current.append(piece)
    return [*calls, current] if current else calls


def _group_tiles(long: list[list[Slice]], heads: int) -> list[list[Slice]]:
    """Consecutive tiles of one chunk per call while the call's padded scores
    (tiles x LONG_TILE rows x query heads x its last tile's keys, padded) stay under
    MAX_CALL_SCORES; at least one tile per call."""
    calls: list[list[Slice]] = []
    for tiles in long:
        current: list[Slice] = []
        for tile in tiles:
            keys = cdiv(tile[3], KEY_CHUNK) * KEY_CHUNK
            if current and (len(current) + 1) * LONG_TILE * heads * keys > MAX_CALL_SCORES:
                calls.append(current)
                current = []
            current.append(tile)
        calls.append(current)
    return calls


def plan_batched(meta: AttentionMetadata, slices: list[Slice], block_size: int,
                 num_heads: int, num_kv_heads: int) -> BatchedPlan:
    """The padded call for these slices of requests' rows (at least one), its mask not
    yet expanded (`_holding_mask`).

    Padding query rows repeat the slice's last row (their output is dropped), and
    padding key slots point at the request's position 0 (always masked), so nothing
    outside the request's own cache is ever read, not even stale NaNs.

    Built in numpy on the host and moved once: a plan is some twenty small array
    operations, each a few microseconds in numpy against several more in torch
    (`benchmarks/attention_kernel.py`'s torch_plan_ms, one decode: 0.22 ms built in
    torch, 0.14-0.17 in numpy). A step builds one per pass, and a head drafting K = 4
    runs five passes a step.
    """
    group = num_heads // num_kv_heads
    # Too few matmuls: repeat the first slice (its copies' rows are dropped).
    copies = max(0, cdiv(MIN_PROBLEMS, num_kv_heads) - len(slices))
    padded = np.array(slices + [slices[0]] * copies, dtype=np.int64)  # [R, 5]
    index, starts, num_q, seq_lens, own = padded.T
    max_q = max(int(num_q[:len(slices)].max()), cdiv(MIN_GEMM_ROWS, group))
    max_len = cdiv(int(seq_lens[:len(slices)].max()), KEY_CHUNK) * KEY_CHUNK
    j = np.arange(max_q)
    last = np.minimum(j[None, :], num_q[:, None] - 1)  # [R, Q]
    rows = starts[:, None] + last
    t = np.arange(max_len)
    t_in = np.where(t[None, :] < seq_lens[:, None], t[None, :], 0)  # [R, L]
    # A tree row's last key is its own, wherever it sits (`Slice`).
    t_in = np.where((own[:, None] >= 0) & (t[None, :] == seq_lens[:, None] - 1),
                    own[:, None], t_in)
    blocks = _host_block_table(meta)[index[:, None], t_in // block_size].astype(np.int64)
    q_pos = seq_lens[:, None] - num_q[:, None] + last  # [R, Q]
    hidden = t[None, None, :] > q_pos[:, :, None]  # [R, Q, L]
    slots = blocks * block_size + t_in % block_size  # [R, L]
    kv_heads = np.arange(num_kv_heads)
    heads = kv_heads[:, None] * group + np.arange(group)[None, :]  # [Hkv, G]
    shape = (len(padded), num_kv_heads, max_q, group)
    q_index = np.broadcast_to(rows[:, None, :, None] * num_heads + heads[None, :, None, :],
                              shape).reshape(-1)
    real_q = (j[None, :] < num_q[:, None]) & (np.arange(len(padded)) < len(slices))[:, None]
    real = np.broadcast_to(real_q[:, None, :, None], shape).reshape(-1)
    out_index = q_index[real]
    gather_out = None
    if int(num_q[:len(slices)].sum()) == meta.num_actual_tokens:
        gather_out = np.empty_like(out_index)
        gather_out[out_index] = np.flatnonzero(real)
    kv_index = (slots[:, None, :] * num_kv_heads + kv_heads[None, :, None]).reshape(-1)
    device = meta.query_start_loc.device

    def moved(array: np.ndarray) -> torch.Tensor:
        # A broadcast view is read-only and strided: torch wants it copied.
        return torch.from_numpy(np.require(array, requirements=("C", "W"))).to(device)

    return BatchedPlan({int(req) for req, *_ in slices}, shape, moved(q_index),
                       moved(kv_index), moved(hidden), None, moved(out_index), moved(real),
                       moved(gather_out) if gather_out is not None else None)


def _host_block_table(meta: AttentionMetadata) -> np.ndarray:
    """The metadata's block table as a host array (no copy on the CPU)."""
    table = meta.block_table
    return (table if table.device.type == "cpu" else table.cpu()).numpy()


def _holding_mask(plan: BatchedPlan) -> BatchedPlan:
    """The plan with its mask expanded once, for every layer of the step."""
    return dataclasses.replace(plan, mask=expand_mask(plan))


def expand_mask(plan: BatchedPlan) -> torch.Tensor:
    """[R*Hkv, Q*G, L] float32 from the plan's [R, Q, L] hidden keys."""
    num_reqs, num_kv_heads, max_q, group = plan.shape
    mask = torch.zeros(plan.hidden.shape, dtype=torch.float32, device=plan.hidden.device)
    mask.masked_fill_(plan.hidden, float("-inf"))
    return mask[:, None, :, None, :].expand(*plan.shape, mask.shape[-1]).reshape(
        num_reqs * num_kv_heads, max_q * group, mask.shape[-1])


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
    mask = plan.mask if plan.mask is not None else expand_mask(plan)
    scores = torch.baddbmm(mask, q.view(problems, max_q * group, head_dim),
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
