"""The compiled layer ops (runner/models/cpu_ops.py). RMSNorm: torch's result, a row's
bits the same alone and in any batch, the packed model's norms, and torch's norm
wherever the compiled one cannot run. The rotation: `Rotary`'s torch arithmetic bit
for bit, on the strided q/k view a layer hands it."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runner.models import cpu_ops
from runner.models.cpu_ops import (
    CompiledNorm,
    compiled_rms_norm,
    compiled_rope,
    norm_for,
    torch_rms_norm,
)
from runner.models.llama import RMSNorm, Rotary
from tests.helpers import needs_compiler

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def rows(num: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num, width, generator=gen) * 3).to(dtype)


def weight(width: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return (torch.rand(width, generator=gen) + 0.5).to(dtype)


def batch_mismatches(norm: Norm, dtype: torch.dtype) -> int:
    """Rows whose result alone differs from the same row in calls of other sizes."""
    x, w = rows(40, 576, dtype), weight(576, dtype)
    alone = torch.cat([norm(x[i:i + 1], w, 1e-5) for i in range(len(x))])
    bad = 0
    for size in (2, 5, 17, 40):
        batched = torch.cat([norm(x[i:i + size], w, 1e-5) for i in range(0, len(x), size)])
        bad += int((batched != alone).any(dim=-1).sum())
    return bad


@needs_compiler
@pytest.mark.parametrize("width", [576, 100, 7])
def test_bfloat16_rounds_as_torch_does(width: int) -> None:
    """torch's formula, rounded once: the sums of squares differ in order only, so
    nearly every element is torch's and none is more than one bfloat16 step away."""
    x, w = rows(64, width, torch.bfloat16), weight(width, torch.bfloat16)
    got, want = compiled_rms_norm(x, w, 1e-5), F.rms_norm(x, (width,), w, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert (got == want).float().mean() > 0.999
    step = want.float().abs() * 2 ** -7
    assert ((got.float() - want.float()).abs() <= step).all()


@needs_compiler
def test_float32_matches_torch() -> None:
    x, w = rows(64, 576, torch.float32), weight(576, torch.float32)
    torch.testing.assert_close(compiled_rms_norm(x, w, 1e-6), F.rms_norm(x, (576,), w, 1e-6),
                               atol=2e-6, rtol=2e-6)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_is_the_same_alone_and_in_any_batch(dtype: torch.dtype) -> None:
    assert batch_mismatches(compiled_rms_norm, dtype) == 0


def test_the_batch_check_catches_a_norm_that_reads_its_batch() -> None:
    """Broken on purpose: one step more on every row when a call has several."""
    def leaky(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch_rms_norm(x, w, eps)
        return torch.nextafter(out, out + 1) if len(x) > 1 else out

    assert batch_mismatches(leaky, torch.float32) > 0


@needs_compiler
def test_strided_rows_and_leading_dimensions() -> None:
    """Rows of a wider buffer (a view, not copied) and [T, H, D] inputs give what their
    contiguous copies give."""
    wide = rows(8, 1152, torch.bfloat16)
    w = weight(576, torch.bfloat16)
    view = wide[:, 576:]
    assert torch.equal(compiled_rms_norm(view, w, 1e-5),
                       compiled_rms_norm(view.contiguous(), w, 1e-5))
    x3 = rows(12, 576, torch.bfloat16).view(3, 4, 576)
    assert torch.equal(compiled_rms_norm(x3, w, 1e-5).view(12, 576),
                       compiled_rms_norm(x3.reshape(12, 576), w, 1e-5))


@needs_compiler
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_what_it_cannot_read_goes_to_torch() -> None:
    """float16, mixed dtypes and a transposed input run torch's norm (same result)."""
    half = rows(4, 64, torch.float16)
    w16 = weight(64, torch.float16)
    assert torch.equal(compiled_rms_norm(half, w16, 1e-5), F.rms_norm(half, (64,), w16, 1e-5))
    x = rows(4, 64, torch.float32)
    w = weight(64, torch.bfloat16)
    assert torch.equal(compiled_rms_norm(x, w, 1e-5), F.rms_norm(x, (64,), w, 1e-5))
    square = rows(64, 64, torch.float32).t()  # last dimension strided
    wf = weight(64, torch.float32)
    assert torch.equal(compiled_rms_norm(square, wf, 1e-5),
                       F.rms_norm(square, (64,), wf, 1e-5))


@needs_compiler
def test_a_packed_norm_runs_compiled_and_still_pickles() -> None:
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    assert norm._packed is None  # unpacked: torch's, gradients included
    norm.pack()
    assert isinstance(norm._packed, CompiledNorm)
    x = rows(3, 576, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(norm(x), compiled_rms_norm(x, norm.weight, 1e-5))
        # what it cannot read (elements spaced) goes to torch
        spaced = rows(3, 1152, torch.bfloat16)[:, ::2]
        assert torch.equal(norm(spaced), torch_rms_norm(spaced, norm.weight, 1e-5))
        unpickled = pickle.loads(pickle.dumps(norm))
        assert isinstance(unpickled._packed, CompiledNorm)
        assert torch.equal(unpickled(x), norm(x))
    assert norm_for(torch.ones(8, dtype=torch.float16), 1e-5) is None


def test_without_a_compiler_the_packed_norm_is_torchs(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("SPECBUDGET_CACHE_DIR", str(tmp_path))
    cpu_ops.load.cache_clear()
    try:
        lib, why = cpu_ops.load()
        assert lib is None and "no C compiler 'no-such-compiler-here'" in why
        norm = RMSNorm(16, 1e-5)
        norm.pack()
        assert norm._packed is None
        x = rows(2, 16, torch.float32)
        assert torch.equal(compiled_rms_norm(x, norm.weight, 1e-5),
                           F.rms_norm(x, (16,), norm.weight, 1e-5))
    finally:
        cpu_ops.load.cache_clear()


def rotary(tokens: int, dim: int, dtype: torch.dtype) -> Rotary:
    gen = torch.Generator().manual_seed(tokens)
    angles = torch.rand(tokens, 1, dim, generator=gen) * 500  # positions up to ~500
    return Rotary.from_cos_sin(angles.cos().to(dtype), angles.sin().to(dtype))


def torch_rotation(rot: Rotary, x: torch.Tensor) -> torch.Tensor:
    """`Rotary.__call__`'s torch arithmetic, written out."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * rot.cos, swapped, rot.signed_sin)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_the_rotation_is_torchs_bit_for_bit(dtype: torch.dtype, tokens: int) -> None:
    """q and k as a layer hands them over: the first 12 heads of a [T, 15, 64]
    projection (rows 15 heads apart). Both paths meet in one model (a write-only pass
    and a full pass write the same keys), so close is not enough."""
    qkv = rows(tokens * 15, 64, dtype).view(tokens, 15, 64)
    x, rot = qkv[:, :12], rotary(tokens, 64, dtype)
    got = compiled_rope(x, rot.cos, rot.signed_sin)
    assert got is not None and got.is_contiguous()
    assert rot.compiled  # its tables checked once: each layer's call checks x alone
    assert torch.equal(got, torch_rotation(rot, x))
    assert torch.equal(rot(x), got)
    # The comparison sees a wrong sign: sin where the first half wants -sin.
    plain_sin = torch.cat((-rot.signed_sin[..., :32], rot.signed_sin[..., 32:]), dim=-1)
    assert not torch.equal(compiled_rope(x, rot.cos, plain_sin.contiguous()), got)


@needs_compiler
def test_a_rotation_it_cannot_run_is_left_to_torch() -> None:
    rot16 = rotary(3, 8, torch.float16)
    assert compiled_rope(rows(3, 16, torch.float16).view(3, 2, 8), rot16.cos,
                         rot16.signed_sin) is None
    rot = rotary(3, 8, torch.float32)
    strided = rows(3, 32, torch.float32).view(3, 2, 16)[:, :, ::2]  # elements spaced
    assert compiled_rope(strided, rot.cos, rot.signed_sin) is None
    assert torch.equal(rot(strided), torch_rotation(rot, strided))
    long_chunk = rotary(cpu_ops.ROPE_MAX_TOKENS + 1, 8, torch.float32)
    assert rot.compiled and not long_chunk.compiled and not rot16.compiled
    chunk_rows = rows(cpu_ops.ROPE_MAX_TOKENS + 1, 16, torch.float32).view(-1, 2, 8)
    assert compiled_rope(chunk_rows, long_chunk.cos, long_chunk.signed_sin) is None
    wanting = rows(3, 16, torch.float32).view(3, 2, 8).requires_grad_()
    assert compiled_rope(wanting, rot.cos, rot.signed_sin) is None
    rot(wanting).sum().backward()  # torch's path: the gradient flows
    assert wanting.grad is not None
