"""Tree rows (AttentionMetadata.tree_prefix): a drafted tree's leaves verified in the
chain's pass. A leaf sits after the chain in the request's rows but sees only the keys
before its prefix and its own key; every backend must give it the bits it would have
at position `prefix` of a sequence without the keys it skips (greedy verification
with leaves must equal plain decoding), and leave every other row unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from tests.helpers import needs_compiler
from tests.runner.test_attention import Batch, batch_of, run

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 32


def tree_batch(computed: int, depth: int, dtype: torch.dtype, block_size: int = 4,
               seed: int = 0, others: bool = True, device: str = "cpu"
               ) -> tuple[Batch, list[int]]:
    """A request verifying t0 and a chain of `depth` drafts, then a leaf per depth
    (rows t0, a1..aD, b1..bD at positions c, c+1..c+D, then c+1..c+D), beside a decode
    and a prefill chunk (`others`). Returns the batch and each leaf's prefix."""
    gen = torch.Generator().manual_seed(seed)
    reqs = [(computed, 1 + 2 * depth)] + ([(9, 1), (0, 6)] if others else [])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    full_k = [randn(c + n, KV_HEADS, HEAD_DIM) for c, n in reqs]
    full_v = [randn(c + n, KV_HEADS, HEAD_DIM) for c, n in reqs]
    queries = [randn(n, HEADS, HEAD_DIM) for _, n in reqs]
    batch = batch_of(reqs, full_k, full_v, queries, block_size, gen, device)
    prefixes = [computed + d for d in range(1, depth + 1)]
    tree = np.full(batch.meta.num_actual_tokens, -1, dtype=np.int32)
    tree[1 + depth:1 + 2 * depth] = prefixes
    meta = dataclasses.replace(batch.meta, tree_prefix=torch.from_numpy(tree).to(device),
                               tree_prefix_cpu=tree)
    return dataclasses.replace(batch, meta=meta), prefixes


def leaf_alone(batch: Batch, depth: int, d: int, prefix: int, block_size: int = 4) -> Batch:
    """Leaf d of `tree_batch` as a plain decode row at position `prefix`: its keys the
    tree's first `prefix` and its own."""
    own = prefix + depth  # index of leaf d in the request's sequence (c + D + d)
    k, v = batch.full_k[0], batch.full_v[0]
    row = batch.meta.query_start_loc_cpu[0] + 1 + depth + d - 1
    keys = torch.cat([k[:prefix], k[own:own + 1]])
    values = torch.cat([v[:prefix], v[own:own + 1]])
    gen = torch.Generator().manual_seed(1)
    return batch_of([(prefix, 1)], [keys], [values], [batch.query[row:row + 1]], block_size,
                    gen)


BACKENDS = ["torch", pytest.param("cpu", marks=needs_compiler)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("computed", "depth"), [(5, 4), (3, 2), (126, 4), (0, 3)])
def test_a_leaf_computes_what_it_would_alone_at_its_prefix(backend: str, dtype: torch.dtype,
                                                           computed: int, depth: int) -> None:
    """Bitwise, in a batch with other requests; prefixes across blocks and across the
    torch path's 128-key chunks (126 + 4)."""
    batch, prefixes = tree_batch(computed, depth, dtype)
    scale = 1 / math.sqrt(HEAD_DIM)
    out, _, _ = run(backend, batch, scale)
    for d, prefix in enumerate(prefixes, start=1):
        alone = leaf_alone(batch, depth, d, prefix)
        want, _, _ = run(backend, alone, scale)
        assert torch.equal(out[1 + depth + d - 1], want[0]), f"leaf {d}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_rows_change_no_other_row(backend: str) -> None:
    """The chain, the decode and the prefill chunk beside the leaves: the same bits as
    the same batch without tree rows; the leaves' K/V are written at their own slots."""
    batch, _ = tree_batch(5, 4, torch.float32)
    scale = 1 / math.sqrt(HEAD_DIM)
    out, key_cache, _ = run(backend, batch, scale)
    plain = dataclasses.replace(batch, meta=dataclasses.replace(
        batch.meta, tree_prefix=None, tree_prefix_cpu=None))
    want, want_keys, _ = run(backend, plain, scale)
    others = np.flatnonzero(batch.meta.tree_prefix_cpu < 0)
    assert torch.equal(out[others], want[others])
    assert torch.equal(key_cache.isnan(), want_keys.isnan())
    assert torch.equal(key_cache.nan_to_num(), want_keys.nan_to_num())
    # ...and the check is real: without their prefixes the leaves see the chain.
    leaves = np.flatnonzero(batch.meta.tree_prefix_cpu >= 0)
    assert not torch.equal(out[leaves], want[leaves])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("prefix", "why"), [(0, "no key"), (99, "past its own")])
def test_a_tree_prefix_out_of_range_is_refused(backend: str, prefix: int, why: str) -> None:
    batch, _ = tree_batch(5, 2, torch.float32)
    tree = batch.meta.tree_prefix_cpu.copy()
    tree[3] = prefix
    meta = dataclasses.replace(batch.meta, tree_prefix=torch.from_numpy(tree),
                               tree_prefix_cpu=tree)
    with pytest.raises(ValueError, match="prefix"):
        run(backend, dataclasses.replace(batch, meta=meta), 0.1)


def test_tree_rows_must_end_their_request() -> None:
    """A tree row before a plain row of its request is refused (the torch path serves
    a request's plain rows as one block)."""
    batch, _ = tree_batch(5, 2, torch.float32, others=False)
    tree = np.full(batch.meta.num_actual_tokens, -1, dtype=np.int32)
    tree[1] = 5
    meta = dataclasses.replace(batch.meta, tree_prefix=torch.from_numpy(tree),
                               tree_prefix_cpu=tree)
    with pytest.raises(ValueError, match="last rows"):
        run("torch", dataclasses.replace(batch, meta=meta), 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_tree_rows_match_torch_interpreted(dtype: torch.dtype) -> None:
    """The GPU path's tree mask against the torch path, on tiny shapes (8-key tiles:
    the skipped keys span tiles)."""
    batch, _ = tree_batch(9, 3, dtype)
    scale = 1 / math.sqrt(HEAD_DIM)
    ref, _, _ = run("torch", batch, scale)
    out, _, _ = run("triton", batch, scale, tile_n=8)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("computed", "depth"), [(5, 4), (1000, 6)])
def test_triton_tree_rows_match_torch_on_cuda(dtype: torch.dtype, computed: int,
                                              depth: int) -> None:
    """The GPU path's tree mask at the default tile (64 keys: a long prefix's skipped
    keys inside one tile or across two), against the torch path on the same device."""
    batch, _ = tree_batch(computed, depth, dtype, block_size=16, device="cuda")
    scale = 1 / math.sqrt(HEAD_DIM)
    ref, _, _ = run("torch", batch, scale)
    out, _, _ = run("triton", batch, scale)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
