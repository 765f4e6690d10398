"""The compiled CPU attention kernel (runner/attention/cpu_paged.c): against the dense
reference, a row bitwise the same alone and in any batch or chunking, inputs it cannot
read refused by name, and the torch path where no compiler builds it."""

from __future__ import annotations

import logging
import math
import platform
from pathlib import Path

import pytest
import torch

from runner import native
from runner.attention import cpu_kernel, get_attention_backend
from runner.config import RunnerConfig
from tests.helpers import needs_compiler
from tests.runner.test_attention import (
    LONG,
    MIXED,
    RowProbe,
    _mismatches,
    check_cache_writes,
    dense_reference,
    make_batch,
    run,
)
from tests.runner.test_tree_attention import tree_batch

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reqs", [MIXED, LONG], ids=["short", "long"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(6, 2, 32), (4, 4, 32), (9, 3, 64), (2, 1, 24), (4, 2, 80)])
def test_kernel_matches_dense_reference(reqs: list[tuple[int, int]], block_size: int,
                                        num_heads: int, num_kv_heads: int, head_dim: int,
                                        dtype: torch.dtype) -> None:
    """Decodes, chunks after a cached prefix, prefills past a tile of 16 rows, heads
    per KV head from 1 to 3, a head size that is no multiple of 16 and one whose values
    are summed partly in register blocks of 64 and partly not (80); caches start NaN,
    so a read of a slot no token owns would poison the output."""
    batch = make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = 1 / math.sqrt(head_dim)
    out, key_cache, value_cache = run("cpu", batch, scale)
    assert out.shape == batch.query.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), dense_reference(batch, scale),
                               atol=TOL[dtype], rtol=TOL[dtype])
    check_cache_writes(batch, key_cache, value_cache)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_is_the_same_alone_and_in_any_batch(dtype: torch.dtype) -> None:
    """The torch path's check (tests/runner/test_attention.py), on the kernel: decode
    rows alone against the same rows in verification chunks and prefill chunks of up to
    200 rows (several tiles) beside other requests."""
    assert _mismatches(RowProbe(dtype, backend="cpu"), trials=120) == 0


@needs_compiler
def test_the_row_check_catches_a_kernel_that_reads_its_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken on purpose: one ulp on every row when more than one request shares the
    call. The check above must see it."""
    from runner.attention import cpu_paged

    real = cpu_paged.CpuPagedAttention.forward

    def leaky(self, query, key, value, key_cache, value_cache, meta, scale):  # type: ignore[no-untyped-def]
        out = real(self, query, key, value, key_cache, value_cache, meta, scale)
        return torch.nextafter(out, out + 1) if meta.num_reqs > 1 else out

    monkeypatch.setattr(cpu_paged.CpuPagedAttention, "forward", leaky)
    assert _mismatches(RowProbe(torch.float32, backend="cpu"), trials=20) > 0


def _outputs(source: Path, flags: tuple[str, ...]) -> list[torch.Tensor]:
    """The kernel built from `source` with `flags` (its own library) on float32 and
    bfloat16 batches of decodes, chunks, prefills, two head layouts, and a drafted
    tree."""
    backend = get_attention_backend("cpu")
    backend._fn = cpu_kernel.bind(  # type: ignore[attr-defined]
        native.compiled(source, flags)).specbudget_paged_attention
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        for reqs, heads in ((MIXED, (9, 3, 64)), (LONG, (9, 3, 64)), (MIXED, (4, 2, 80))):
            batch = make_batch(reqs, *heads, 16, dtype)
            outs.append(backend.forward(batch.query, batch.key, batch.value,
                                        *batch.clone_caches(), batch.meta, 0.125))
        tree, _ = tree_batch(21, 4, dtype)
        outs.append(backend.forward(tree.query, tree.key, tree.value, *tree.clone_caches(),
                                    tree.meta, 0.125))
    return outs


PORTABLE = (*(f for f in cpu_kernel.FLAGS if f != "-march=native"), "-march=x86-64")
needs_x86_vectors = pytest.mark.skipif(
    platform.machine() != "x86_64" or not {"avx2", "fma"} <= set(native.cpu_flags().split()),
    reason="compares an AVX2 or AVX-512 build with a plain x86-64 one: needs such a CPU")


@needs_compiler
@needs_x86_vectors
def test_the_vector_build_gives_the_portable_builds_bits() -> None:
    """The kernel for this CPU (its multiply-adds, broadcasts and selects as AVX2 or
    AVX-512 instructions, 8 or 16 lanes) against the same source for plain x86-64 (no
    AVX: fmaf lane by lane): every output bit the same, so a row's bits do not depend on
    the machine's vectors."""
    source = cpu_kernel.SOURCE
    assert all(torch.equal(a, b) for a, b in zip(
        _outputs(source, cpu_kernel.FLAGS), _outputs(source, PORTABLE), strict=True))


@needs_compiler
@needs_x86_vectors
def test_the_bit_check_catches_a_vector_multiply_add_that_rounds_twice(
        tmp_path: Path) -> None:
    """Broken on purpose: the vector multiply-add as a multiply then an add (two
    roundings where fmaf has one). The check above must see it."""
    broken = tmp_path / "cpu_paged.c"
    text = cpu_kernel.SOURCE.read_text()
    for width in ("256", "512"):
        fused = f"_mm{width}_fmadd_ps((__m{width})a, (__m{width})b, (__m{width})c)"
        assert fused in text
        text = text.replace(fused, f"_mm{width}_add_ps(_mm{width}_mul_ps((__m{width})a, "
                                   f"(__m{width})b), (__m{width})c)")
    broken.write_text(text)
    assert not all(torch.equal(a, b) for a, b in zip(
        _outputs(broken, cpu_kernel.FLAGS), _outputs(cpu_kernel.SOURCE, PORTABLE),
        strict=True))


@needs_compiler
def test_inputs_it_cannot_read_are_refused_by_name() -> None:
    backend = get_attention_backend("cpu")
    batch = make_batch(MIXED, 6, 2, 32, 4, torch.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        backend.forward(batch.query, batch.key, batch.value, *batch.clone_caches(),
                        batch.meta, 0.1)
    batch = make_batch(MIXED, 6, 2, 32, 4)
    key_cache, value_cache = batch.clone_caches()
    with pytest.raises(ValueError, match="contiguous KV caches"):
        backend.forward(batch.query, batch.key, batch.value, key_cache.transpose(1, 2),
                        value_cache.transpose(1, 2), batch.meta, 0.1)
    with pytest.raises(ValueError, match="keys and values of the caches' dtype"):
        backend.forward(batch.query, batch.key.double(), batch.value, key_cache, value_cache,
                        batch.meta, 0.1)
    with pytest.raises(ValueError, match=r"keys and values of shape \[T, 2, 32\]"):
        backend.forward(batch.query, batch.key[:, :1], batch.value[:, :1], key_cache,
                        value_cache, batch.meta, 0.1)
    # The metadata's layout is checked once per pass (a runner builds a fresh one per
    # pass): a fresh backend for each broken one.
    slots = batch.meta.slot_mapping
    batch.meta.slot_mapping = slots.int()
    with pytest.raises(ValueError, match="slot_mapping as a CPU int64"):
        get_attention_backend("cpu").forward(batch.query, batch.key, batch.value, key_cache,
                                             value_cache, batch.meta, 0.1)
    batch.meta.slot_mapping = slots
    batch.meta.seq_lens = batch.meta.seq_lens.long()
    with pytest.raises(ValueError, match="seq_lens as a CPU int32"):
        get_attention_backend("cpu").forward(batch.query, batch.key, batch.value, key_cache,
                                             value_cache, batch.meta, 0.1)
    with pytest.raises(ValueError, match="attention_backend=cpu runs on the CPU only"):
        RunnerConfig(device="cuda", attention_backend="cpu")


@needs_compiler
def test_metadata_that_would_read_outside_the_caches_is_refused() -> None:
    """The kernel reads and writes raw pointers: a block id past the cache, a sequence
    shorter than its rows, fewer requests than num_reqs or a slot outside the caches
    fail by name before the kernel reads or writes anything."""
    backend = get_attention_backend("cpu")
    for broken, message in (("block id", "out of range"), ("seq_len", "out of range"),
                            ("num_reqs", "fewer than num_reqs=5"),
                            ("slot", "slot of slot_mapping"), ("negative slot", "slot_mapping")):
        batch = make_batch(MIXED, 6, 2, 32, 4)
        key_cache, value_cache = batch.clone_caches()
        if broken == "block id":
            batch.meta.block_table[1, 0] = key_cache.shape[0]
        elif broken == "seq_len":
            batch.meta.seq_lens[2] = 1  # 6 rows cannot sit in 1 position
        elif broken == "num_reqs":
            batch.meta.num_reqs += 1
        else:
            batch.meta.slot_mapping[-1] = (-1 if broken == "negative slot"
                                           else key_cache.shape[0] * key_cache.shape[1])
        before = key_cache.clone(), value_cache.clone()
        with pytest.raises(ValueError, match=message):
            backend.forward(batch.query, batch.key, batch.value, key_cache, value_cache,
                            batch.meta, 0.1)
        for cache, was in zip((key_cache, value_cache), before, strict=True):
            assert torch.equal(cache.view(torch.uint8), was.view(torch.uint8))  # NaN-filled


@needs_compiler
def test_auto_picks_the_kernel_on_the_cpu_for_its_dtypes() -> None:
    assert RunnerConfig(dtype="float32").backend_name == "cpu"
    assert RunnerConfig(dtype="bfloat16").backend_name == "cpu"
    assert RunnerConfig(dtype="float16").backend_name == "torch"  # not a kernel dtype
    assert RunnerConfig(dtype="float32", attention_backend="torch").backend_name == "torch"


def test_without_a_compiler_auto_falls_back_to_torch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
        ) -> None:
    """No compiler: one warning that says why, "auto" serves with the torch path, and
    asking for "cpu" by name fails with the reason rather than running without it."""
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("SPECBUDGET_CACHE_DIR", str(tmp_path))
    cpu_kernel.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="specbudget.runner"):
            assert RunnerConfig(dtype="float32").backend_name == "torch"
        assert "no C compiler 'no-such-compiler-here'" in caplog.text
        with pytest.raises(RuntimeError, match="needs its kernel: no C compiler"):
            get_attention_backend("cpu")
    finally:
        cpu_kernel.load.cache_clear()


@needs_compiler
def test_a_compile_error_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    """A source the compiler rejects (a broken checkout) leaves the torch path serving,
    and the reason carries the compiler's own message."""
    broken = tmp_path / "cpu_paged.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu_kernel, "SOURCE", broken)
    monkeypatch.setenv("SPECBUDGET_CACHE_DIR", str(tmp_path))
    cpu_kernel.load.cache_clear()
    try:
        lib, why = cpu_kernel.load()
        assert lib is None and "building cpu_paged.c failed" in why and "error" in why
        assert not list((tmp_path / "kernels").glob("*.so"))
    finally:
        cpu_kernel.load.cache_clear()


@needs_compiler
def test_the_library_is_built_once_per_source(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setenv("SPECBUDGET_CACHE_DIR", str(tmp_path))
    cpu_kernel.load.cache_clear()
    try:
        assert cpu_kernel.load()[0] is not None
        built = list((tmp_path / "kernels").glob("cpu_paged-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        cpu_kernel.load.cache_clear()
        assert cpu_kernel.load()[0] is not None
        assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    finally:
        cpu_kernel.load.cache_clear()
