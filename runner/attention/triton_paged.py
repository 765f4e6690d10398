"""Paged attention in Triton: the GPU path, tested against the torch path.

One launch serves the whole mixed batch (fresh prefills, prefill chunks after a cached
prefix, decodes, verified drafts): every request is "num_q queries that end at
seq_len", so there is no prefill/decode split. The grid is (query tiles, KV heads):

  * A program owns up to BLOCK_Q consecutive query tokens of one request and the GROUP
    query heads that share one KV head (grouped-query attention). Those
    BLOCK_M = BLOCK_Q * GROUP rows are one matrix, so each K/V tile read from the cache
    feeds every head of the group through one tl.dot instead of GROUP separate reads.
  * It walks the request's keys in tiles of TILE_N, finding each key's cache slot
    through the block table, with an online softmax in fp32 (running max and sum,
    rescaled as the max grows), and stops at the last key its last query may see.

K/V are written with `write_kv` (one index_copy_ per cache): a scatter of T rows is a
single memory-bound launch already, so a Triton kernel would only save one launch.
"""

from __future__ import annotations

import math

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from runner.attention.backend import AttentionBackend
from runner.attention.metadata import AttentionMetadata


# Kernel arguments stay unannotated: Triton reads annotations as specialisation hints.
@triton.jit
def _find_request(query_start_loc_ptr, q_tile, num_reqs, BLOCK_Q: tl.constexpr):  # type: ignore[no-untyped-def]
    """The request that owns query tile `q_tile`: binary search over its first tiles.

    Request i owns the tiles [qsl[i] // BLOCK_Q + i, qsl[i + 1] // BLOCK_Q + i + 1):
    floor-dividing the flat token offset and adding one spare tile per request gives
    every request at least cdiv(num_q_i, BLOCK_Q) tiles without a host-side prefix
    sum. Worked example, BLOCK_Q = 4, query lens [2, 5, 3] -> qsl [0, 2, 7, 10]:
      first tiles = [0 // 4 + 0, 2 // 4 + 1, 7 // 4 + 2] = [0, 1, 3]
      grid size   = 10 // 4 + 3 = 5 tiles: 0 -> req 0 (queries 0-1), 1-2 -> req 1
      (queries 0-3, 4), 3-4 -> req 2 (queries 0-2; tile 4 is spare and returns).
    """
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_reqs"])
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, tree_prefix_ptr,
    num_reqs, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_TREE: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_tile, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    num_q = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_tile = q_tile - (q_start // BLOCK_Q + req)
    if local_tile * BLOCK_Q >= num_q:  # a spare tile (see _find_request)
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - num_q  # keys cached before this step: query j sits there + j

    # Row m = (query token m // GROUP, query head kv_head * GROUP + m % GROUP).
    # E.g. GROUP = 3, BLOCK_M = 16 -> BLOCK_Q = 5: rows 0-2 are token 0's heads 0-2 of
    # this KV head, rows 3-5 token 1's, ..., rows 12-14 token 4's; row 15 is padding.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_local = local_tile * BLOCK_Q + offs_m // GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_local < num_q)
    q_pos = context_len + q_local  # absolute position: the last key this row may see
    head = kv_head * GROUP + offs_m % GROUP
    q_rows = (q_start + q_local) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    # A tree row (metadata.py) skips the keys in [its prefix, its own position); a plain
    # row's skip range is empty. Every tree prefix is >= 1, so key 0 stays seen.
    skip_lo = q_pos
    if HAS_TREE:
        prefix = tl.load(tree_prefix_ptr + q_start + q_local, mask=row_ok, other=-1)
        skip_lo = tl.where(prefix >= 0, prefix, q_pos)

    # Every row (padding too, as q_pos >= 0) sees key 0, which is in the first tile, so
    # the running max is finite after it and exp2(m_i - m_new) never meets -inf - -inf.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Causal bound: this tile's last query sits at context_len + min(num_q, end) - 1,
    # so e.g. a 5-query chunk after 9 cached keys, tile 0 of BLOCK_Q = 4, reads keys
    # 0..12 (13 of them) and never the 14th.
    num_keys = context_len + tl.minimum(num_q, (local_tile + 1) * BLOCK_Q)
    offs_n = tl.arange(0, TILE_N)
    for start in range(0, num_keys, TILE_N):
        k_pos = start + offs_n
        k_ok = k_pos < num_keys
        # Key at position p lives in slot p % BLOCK_SIZE of physical block
        # block_table[req, p // BLOCK_SIZE]; gathered per key, so a tile may span
        # blocks (block_size 4, TILE_N 64 -> 16 blocks) or part of one.
        block = tl.load(block_table_ptr + req * stride_bt + k_pos // BLOCK_SIZE,
                        mask=k_ok, other=0).to(tl.int64)
        slot = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + slot[None, :] + offs_d[:, None],  # [HEAD_DIM, TILE_N]
                    mask=k_ok[None, :], other=0.0)
        # Scores in log2 units (scale * log2(e) folded in) so exp2 replaces exp.
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        seen = (k_pos[None, :] <= q_pos[:, None]) & (
            (k_pos[None, :] < skip_lo[:, None]) | (k_pos[None, :] == q_pos[:, None]))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot[:, None] + offs_d[None, :],  # [TILE_N, HEAD_DIM]
                    mask=k_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_rows = (q_start + q_local) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class TritonPagedAttention(AttentionBackend):
    """Unified paged attention for mixed batches in one Triton launch (CUDA).

    `block_m` is the rows per program (query tokens x heads of one KV-head group) and
    `tile_n` the keys per softmax step; both powers of two. On a GPU tl.dot needs
    tile_n >= 16; the interpreter (TRITON_INTERPRET=1) accepts smaller tiles, which the
    CPU tests use to exercise the multi-tile online softmax on tiny sequences.
    """

    name = "triton"

    def __init__(self, block_m: int = 16, tile_n: int = 64) -> None:
        if not (_is_pow2(block_m) and _is_pow2(tile_n)):
            raise ValueError(f"block_m ({block_m}) and tile_n ({tile_n}) must be powers of two")
        self.block_m = block_m
        self.tile_n = tile_n

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_tokens = meta.num_actual_tokens
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
        self._check(query, key_cache, value_cache, num_heads, num_kv_heads, head_dim)
        self.write(key, value, key_cache, value_cache, meta)
        out = query.new_empty((num_tokens, num_heads, head_dim))
        if num_tokens == 0:
            return out
        group = num_heads // num_kv_heads
        block_m = max(self.block_m, triton.next_power_of_2(group))
        block_q = block_m // group
        grid = (num_tokens // block_q + meta.num_reqs, num_kv_heads)
        _paged_attention_kernel[grid](
            out, query, key_cache, value_cache,
            meta.query_start_loc, meta.seq_lens, meta.block_table,
            meta.tree_prefix if meta.tree_prefix is not None else meta.seq_lens,
            meta.num_reqs, scale * math.log2(math.e),
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            meta.block_table.stride(0),
            GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
            BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=self.tile_n,
            # fp32 inputs: exact products, not TF32, so the GPU path matches torch.
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            HAS_TREE=meta.tree_prefix is not None,
        )
        return out

    def _check(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of "
                             f"num_kv_heads {num_kv_heads}")
        if not _is_pow2(head_dim):
            raise ValueError(f"head_dim {head_dim} must be a power of two")
        if key_cache.stride() != value_cache.stride():
            raise ValueError("key_cache and value_cache must share one layout")
        if query.stride(2) != 1 or key_cache.stride(3) != 1:
            raise ValueError("query and the caches need a contiguous head_dim")
        if query.is_cuda and self.tile_n < 16:
            raise ValueError(f"tile_n {self.tile_n} < 16: tl.dot needs K >= 16 on a GPU")
