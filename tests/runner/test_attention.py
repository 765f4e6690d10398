"""Paged attention: the torch path against a dense reference, Triton against torch.

A batch is a list of (num_computed, num_new) per request: num_computed keys already in
the cache from earlier steps, num_new query tokens scheduled now (their K/V are written
by the backend). Block tables are shuffled, the caches start as NaN and every table
pads with a NaN block, so a read of a slot no token owns poisons the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from runner.attention import (
    AttentionBackend,
    AttentionMetadata,
    cpu_kernel,
    get_attention_backend,
    torch_paged,
)
from runner.attention.torch_paged import TorchPagedAttention

# A decode, a fresh prefill, a chunk continuing after a 9-token cached prefix
# (first query at position 9, mid-block for block_size 4 and 16), another decode.
MIXED = [(13, 1), (0, 7), (9, 6), (20, 1)]
# Long chunks (over BATCHED_MAX_QUERY rows: calls of their own, cut into tiles of
# LONG_TILE rows past 64) beside short queries (one padded call for all), including a
# query of exactly the batched limit.
LONG = [(0, 40), (13, 1), (30, 20), (5, 32), (0, 33), (3, 3), (0, 150), (70, 129)]


@dataclass
class Batch:
    """One step's inputs, plus each request's whole K/V sequence held contiguously."""

    query: torch.Tensor  # [T, num_heads, head_dim]
    key: torch.Tensor  # [T, num_kv_heads, head_dim]
    value: torch.Tensor  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    meta: AttentionMetadata
    full_k: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim]
    full_v: list[torch.Tensor]
    slots: list[list[int]]  # per request, the cache slot of each position 0..seq_len-1

    def clone_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_cache.clone(), self.value_cache.clone()


def make_batch(reqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int,
               head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
               device: str = "cpu", seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    full_k = [randn(c + n, num_kv_heads, head_dim) for c, n in reqs]
    full_v = [randn(c + n, num_kv_heads, head_dim) for c, n in reqs]
    queries = [randn(n, num_heads, head_dim) for _, n in reqs]
    return batch_of(reqs, full_k, full_v, queries, block_size, gen, device)


def batch_of(reqs: list[tuple[int, int]], full_k: list[torch.Tensor],
             full_v: list[torch.Tensor], queries: list[torch.Tensor], block_size: int,
             gen: torch.Generator, device: str = "cpu") -> Batch:
    """A step over these requests' whole K/V sequences and new queries: the cached
    prefix written at shuffled blocks of NaN caches, the new rows left to the pass."""
    num_kv_heads, head_dim = full_k[0].shape[1:]
    dtype = full_k[0].dtype
    seq_lens = [c + n for c, n in reqs]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    # Two spare blocks nobody owns; the last one pads every block table.
    num_blocks = sum(blocks_per_req) + 2
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    pad_block = physical[-1]
    table = []
    for nb in blocks_per_req:
        table.append(physical[:nb] + [pad_block] * (max(blocks_per_req) - nb))
        physical = physical[nb:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    flat_k, flat_v = key_cache.view(-1, num_kv_heads, head_dim), value_cache.view(
        -1, num_kv_heads, head_dim)

    slots: list[list[int]] = []
    slot_mapping: list[int] = []
    for i, (computed, new) in enumerate(reqs):
        slots.append([table[i][p // block_size] * block_size + p % block_size
                      for p in range(computed + new)])
        for p in range(computed):  # earlier steps wrote the cached prefix
            flat_k[slots[i][p]] = full_k[i][p]
            flat_v[slots[i][p]] = full_v[i][p]
        slot_mapping += slots[i][computed:]

    q_lens = [n for _, n in reqs]
    query_start_loc = [0]
    for n in q_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    meta = AttentionMetadata(
        num_actual_tokens=sum(q_lens), num_reqs=len(reqs),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens,
    )
    return Batch(
        query=torch.cat(queries).to(device),
        key=torch.cat([k[c:] for k, (c, _) in zip(full_k, reqs, strict=True)]).to(device),
        value=torch.cat([v[c:] for v, (c, _) in zip(full_v, reqs, strict=True)]).to(device),
        key_cache=key_cache.to(device), value_cache=value_cache.to(device), meta=meta,
        full_k=full_k, full_v=full_v, slots=slots,
    )


def dense_reference(batch: Batch, scale: float) -> torch.Tensor:
    """Per request: full K/V in order, an explicit causal mask, plain softmax, float64."""
    outs = []
    starts = batch.meta.query_start_loc_cpu
    group = batch.query.shape[1] // batch.full_k[0].shape[1]
    for i, (k, v) in enumerate(zip(batch.full_k, batch.full_v, strict=True)):
        q = batch.query[starts[i]:starts[i + 1]].cpu().double()
        k = k.double().repeat_interleave(group, dim=1)  # query head h reads KV head h // group
        v = v.double().repeat_interleave(group, dim=1)
        seq_len, num_q = k.shape[0], q.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - num_q, seq_len)
        causal = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [num_q, seq_len]
        scores = scores.masked_fill(~causal, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def run(backend_name: str, batch: Batch, scale: float, **kwargs: int
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output and the caches it wrote, on fresh copies of the batch's caches."""
    if backend_name in ("torch", "cpu"):
        backend: AttentionBackend = get_attention_backend(backend_name)
    else:
        from runner.attention.triton_paged import TritonPagedAttention

        backend = TritonPagedAttention(**kwargs)
    key_cache, value_cache = batch.clone_caches()
    out = backend.forward(batch.query, batch.key, batch.value, key_cache, value_cache,
                          batch.meta, scale)
    return out, key_cache, value_cache


def check_cache_writes(batch: Batch, key_cache: torch.Tensor,
                       value_cache: torch.Tensor) -> None:
    """Every position of every request is at its slot; every other slot is untouched."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    flat_k = key_cache.view(-1, num_kv_heads, head_dim).cpu()
    flat_v = value_cache.view(-1, num_kv_heads, head_dim).cpu()
    owned = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    for k, v, slots in zip(batch.full_k, batch.full_v, batch.slots, strict=True):
        assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
        owned[slots] = True
    assert flat_k[~owned].isnan().all() and flat_v[~owned].isnan().all()


# (a) torch path against the dense reference ------------------------------------------

@pytest.mark.parametrize("reqs", [MIXED, LONG], ids=["short", "long"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4)])
def test_torch_path_matches_dense_reference(reqs: list[tuple[int, int]], block_size: int,
                                            num_heads: int, num_kv_heads: int) -> None:
    batch = make_batch(reqs, num_heads, num_kv_heads, head_dim=32, block_size=block_size)
    scale = 1 / math.sqrt(32)
    out, key_cache, value_cache = run("torch", batch, scale)
    assert out.shape == batch.query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dense_reference(batch, scale),
                               atol=1e-5, rtol=1e-5)
    check_cache_writes(batch, key_cache, value_cache)


def test_a_long_chunk_runs_in_bounded_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the scores of a call capped low, a long chunk runs in several calls of
    whole tiles, each under the cap, holding expanded masks for the step only up to
    their own cap, every row served once; the output still matches the dense
    reference."""
    # Two tiles of 64 rows x 9 heads x 512 keys: the 300-row chunk's five tiles (keys
    # padded to 384, 384, 512, 512, 512) run as 2 + 2 + 1, the 90-row chunk's two as one.
    monkeypatch.setattr(torch_paged, "MAX_CALL_SCORES", 2 * 64 * 9 * 512)
    batch = make_batch([(200, 300), (7, 1), (0, 90)], 9, 3, head_dim=32, block_size=16)
    # Room for one long call's mask: the first is held, the other three expand per call.
    monkeypatch.setattr(torch_paged, "MAX_HELD_MASK_BYTES", 4 * 2 * 64 * 9 * 384)
    backend = TorchPagedAttention()
    plans = backend._split(batch.meta, (16, 9, 3))
    assert [plan.mask is None for plan in plans] == [False, False, True, True, True]
    long = plans[1:]
    for plan in long:
        num_reqs, num_kv_heads, max_q, group = plan.shape
        assert num_reqs * num_kv_heads * max_q * group * plan.hidden.shape[-1] <= (
            torch_paged.MAX_CALL_SCORES)
    served = torch.cat([plan.out_index for plan in plans])
    assert sorted(served.tolist()) == list(range(batch.query.numel() // 32))
    scale = 1 / math.sqrt(32)
    out, _, _ = run("torch", batch, scale)
    torch.testing.assert_close(out.double(), dense_reference(batch, scale),
                               atol=1e-5, rtol=1e-5)


def test_short_queries_run_in_calls_of_like_length() -> None:
    """Decodes and verifications of many lengths run in calls of at most
    SHORT_CALL_KEYS padded request-keys (one request past it runs alone), each padded
    only to its own longest: a 40-key decode never pads to the 900-key request beside
    it. Every row is served once, and the output still matches the dense reference."""
    lens = [40, 900, 130, 60, 260, 90, 120, 70, 300, 50, 1500, 100]
    batch = make_batch([(seen - rows, rows) for seen, rows in
                        zip(lens, [1, 3, 1, 5, 1, 1, 2, 1, 1, 4, 1, 1], strict=True)],
                       9, 3, head_dim=32, block_size=16)
    plans = TorchPagedAttention()._split(batch.meta, (16, 9, 3))
    limit, chunk = torch_paged.SHORT_CALL_KEYS, torch_paged.KEY_CHUNK
    keys = [plan.hidden.shape[-1] for plan in plans]
    assert len(plans) > 1 and keys == sorted(keys)
    for plan in plans:
        assert len(plan.reqs) == 1 or len(plan.reqs) * plan.hidden.shape[-1] <= limit
        seen = [lens[r] for r in plan.reqs]
        assert plan.hidden.shape[-1] == -(-max(seen) // chunk) * chunk
    assert keys[0] == chunk  # the shortest decodes pad to one chunk, not 1,536 keys
    served = torch.cat([plan.out_index for plan in plans])
    assert sorted(served.tolist()) == list(range(batch.query.numel() // 32))
    scale = 1 / math.sqrt(32)
    out, _, _ = run("torch", batch, scale)
    torch.testing.assert_close(out.double(), dense_reference(batch, scale),
                               atol=1e-5, rtol=1e-5)


# (a2) a row's output does not depend on what shares the pass -------------------------

class RowProbe:
    """Requests over one random paged cache (9 query heads over 3 KV heads, like the
    default model); `rows` attends a batch and returns each (request, position)'s row."""

    def __init__(self, dtype: torch.dtype, seed: int = 0, backend: str = "torch") -> None:
        gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.backend = backend
        self.key_cache = torch.randn(320, 16, 3, 64, generator=gen).to(dtype)
        self.value_cache = torch.randn(320, 16, 3, 64, generator=gen).to(dtype)
        self.tables = [torch.randperm(320, generator=gen)[:128].int() for _ in range(12)]
        self.queries = torch.randn(12, 2048, 9, 64, generator=gen).to(dtype)

    def rows(self, reqs: list[tuple[int, int, int]]) -> dict[tuple[int, int], torch.Tensor]:
        """reqs: (request, first position, rows); keys already in the cache."""
        positions = [(r, p) for r, first, n in reqs for p in range(first, first + n)]
        slots = torch.tensor([int(self.tables[r][p // 16]) * 16 + p % 16 for r, p in positions])
        starts = [0]
        for _, _, n in reqs:
            starts.append(starts[-1] + n)
        lens = [first + n for _, first, n in reqs]
        meta = AttentionMetadata(
            len(positions), len(reqs), torch.tensor(starts, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32),
            torch.stack([self.tables[r] for r, _, _ in reqs]), slots,
            max(n for *_, n in reqs), max(lens), starts, lens)
        query = torch.stack([self.queries[r, p] for r, p in positions])
        key = self.key_cache.view(-1, 3, 64)[slots].clone()
        value = self.value_cache.view(-1, 3, 64)[slots].clone()
        out = get_attention_backend(self.backend).forward(query, key, value, self.key_cache,
                                                          self.value_cache, meta, 0.125)
        return dict(zip(positions, out, strict=True))


def _mismatches(probe: RowProbe, trials: int, seed: int = 0) -> int:
    """Random trials: a decode row alone, then the same row inside a chunk of its
    request beside 0-6 other requests (decodes, verifications, short chunks) at other
    lengths. The chunk is verification-shaped (1-8 rows around it) or, one trial in
    three, a prefill chunk of up to 200 rows (over `BATCHED_MAX_QUERY`: a call of its
    own), as when the budget cuts a prompt elsewhere. How many trials differ bitwise."""
    rng = torch.Generator().manual_seed(seed)

    def draw(high: int, low: int = 0) -> int:
        return int(torch.randint(low, high, (1,), generator=rng))

    bad = 0
    for _ in range(trials):
        req, pos = draw(12), draw(1900)
        alone = probe.rows([(req, pos, 1)])[(req, pos)]
        first = max(0, pos - draw(200 if draw(3) == 0 else 8))
        others = [(r, draw(1500), (1, 1, 5, 17)[draw(4)])
                  for r in torch.randperm(12, generator=rng)[:draw(7)].tolist() if r != req]
        cut = draw(len(others) + 1)
        batch = [*others[:cut], (req, first, pos - first + 1 + draw(4)), *others[cut:]]
        bad += not torch.equal(alone, probe.rows(batch)[(req, pos)])
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_is_the_same_alone_and_in_any_batch(dtype: torch.dtype) -> None:
    assert _mismatches(RowProbe(dtype), trials=120) == 0


def test_the_row_check_catches_a_batch_dependent_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch_paged._attend_batched

    def leaky(query, key_cache, value_cache, plan, scale, out):  # type: ignore[no-untyped-def]
        res = real(query, key_cache, value_cache, plan, scale, out)
        return torch.nextafter(res, res + 1) if len(plan.reqs) > 1 else res

    monkeypatch.setattr(torch_paged, "_attend_batched", leaky)
    assert _mismatches(RowProbe(torch.float32), trials=20) > 0


# (b) Triton path under the interpreter, against the torch path ------------------------

TOL = {torch.float32: 1e-4, torch.float16: 2e-2}
# Tiny mixed batches: a chunk after a prefix spanning two query tiles (8 queries from
# flat offset 3), a fresh prefill, a decode; seq_len <= 24.
TINY = [(1, 2), (16, 8), (0, 5), (23, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "tile_n"), [
    (4, 2, 16, 8),  # GQA group 2; 8-key tiles: up to 3 online-softmax steps
    (3, 1, 32, 16),  # group 3 (BLOCK_Q = 5, one padding row per tile)
    (2, 2, 16, 64),  # no GQA; the default tile holds every key
])
def test_triton_matches_torch_interpreted(dtype: torch.dtype, num_heads: int,
                                          num_kv_heads: int, head_dim: int,
                                          tile_n: int) -> None:
    batch = make_batch(TINY, num_heads, num_kv_heads, head_dim, block_size=4, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    ref, ref_k, ref_v = run("torch", batch, scale)
    out, key_cache, value_cache = run("triton", batch, scale, tile_n=tile_n)
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(key_cache.isnan(), ref_k.isnan())
    torch.testing.assert_close(key_cache, ref_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, ref_v, equal_nan=True, atol=0, rtol=0)


def test_triton_rejects_unsupported_shapes() -> None:
    batch = make_batch([(0, 2)], 3, 2, 16, block_size=4)
    backend = get_attention_backend("triton")
    assert backend.name == "triton"
    with pytest.raises(ValueError, match="multiple"):
        backend.forward(batch.query, batch.key, batch.value, *batch.clone_caches(),
                        batch.meta, 0.25)
    with pytest.raises(ValueError, match="powers of two"):
        type(backend)(tile_n=24)  # type: ignore[call-arg]


# (c) Triton on CUDA against torch on CUDA ---------------------------------------------

GPU_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
# 8 requests: a 1024-token prefill, prefill chunks after cached prefixes (one mid-block),
# verify-shaped 5-token steps, decodes at short and long contexts.
GPU_MIXED = [(0, 1024), (300, 200), (37, 64), (1000, 5), (4095, 1), (17, 1), (511, 5),
             (2048, 1)]
GPU_DECODES = [(64 + 31 * i, 1) for i in range(64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reqs", [GPU_MIXED, GPU_DECODES], ids=["mixed", "decodes64"])
def test_triton_matches_torch_on_cuda(reqs: list[tuple[int, int]], dtype: torch.dtype
                                      ) -> None:
    # SmolLM2-135M's attention: 9 query heads over 3 KV heads, head_dim 64.
    batch = make_batch(reqs, 9, 3, 64, block_size=16, dtype=dtype, device="cuda")
    scale = 1 / 8
    ref, ref_k, ref_v = run("torch", batch, scale)
    out, key_cache, value_cache = run("triton", batch, scale)
    err = (out.float() - ref.float()).abs().max().item()
    torch.testing.assert_close(out, ref, atol=GPU_TOL[dtype], rtol=GPU_TOL[dtype],
                               msg=lambda m: f"{m}\nmax abs err {err:.3g}")
    torch.testing.assert_close(key_cache, ref_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, ref_v, equal_nan=True, atol=0, rtol=0)


# The benchmark runs (quick mode) and reports what it claims; no timing thresholds.

def test_attention_benchmark_quick(tmp_path: Path) -> None:
    from benchmarks import attention_kernel

    report = attention_kernel.main(["--quick", "--out", str(tmp_path / "a.json")])
    assert (tmp_path / "a.json").exists()
    assert report["results"] and all(r["torch_ms"] > 0 for r in report["results"])
    assert all(r["torch_plan_ms"] > 0 for r in report["results"])  # timed apart
    if not torch.cuda.is_available():
        assert "CUDA" in report["triton"]
    if not torch.cuda.is_available() and cpu_kernel.available():
        # the CPU's compiled kernel, timed beside the torch path and compared with it
        assert all(r["cpu_ms"] > 0 and r["torch_over_cpu"] > 0 for r in report["results"])
        assert all(r["max_abs_diff"] < 0.05 for r in report["results"])
