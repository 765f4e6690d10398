"""A drafter's linear layers: a kernel of its own for its small calls.

A drafter proposes; the target verifies. So a drafter's rows need not have the bits
they would have in a call of another size, and its calls need not go through the
row-invariant kernel the target must use (runner/models/kernel_select.py). They are
also small: an eagle head's passes multiply a row or a few by six matrices of 0.6-9.4
MB in bfloat16 (fc for context rows, q/k/v, o, gate/up, down, the draft vocabulary's
LM head), each cold after the target's pass, and oneDNN pays a fixed cost per call
that such a matrix cannot hide, more so where the row-invariant kernel slices a
reduction past 768 inputs into calls of its own. Two kernels, by the CPU:

- bfloat16 (gemv_bf16.c, AVX512_BF16): one row through the default eagle head's six
  matrices, each cold (a /tmp timing, 2 threads, Intel AMX machine): the target's
  kernel ~950 us, oneDNN unsliced ~700, this kernel ~470.
- float32 (gemv_f32.c, AVX2 and FMA: where "auto" serves float32 because the CPU has
  no bfloat16 instructions): the weight held in bfloat16, half the bytes a call
  streams, widened in registers. A drafter's weights rounded to bfloat16 propose what
  the target then verifies, so speculation stays lossless. It takes calls of any
  number of rows: it sums each output in one order whatever the call, so a split pass
  (a pass's K/V, then its readout rows alone: drafter.py) drafts from the bits of the
  whole pass, as with the target's row-invariant kernel. An eagle head drafting
  chains of 4 on the AVX2 EPYC (2026-12-07, a random head, always drafting): the
  drafter's share of a step 15.9 ms with oneDNN, 8.7 ms with this kernel. Where the
  target runs from GGUF blocks (runner/models/linear_blocks.py) a float32 head's
  weights are rounded to Q8_0 blocks and run on the target's block kernel instead
  (`draft_kernel`): 1.06 bytes a weight where this one streams 2.

Calls of more than `MAX_ROWS` rows to the bfloat16 kernel (a verification's rows in
an eagle head's first pass, a prefill's context rows, 16 requests' steps) take oneDNN
where the target runs it, in one call however wide the reduction (the row-invariant
kernel's slices and row cap are for the target), else the target's own kernel. The
head's six matrices at 5 / 7 / 9 rows, each cold: the target's kernel ~1,510 us,
unsliced ~1,230, the bfloat16 kernel 1,640-2,050 (a /tmp timing).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runner import native
from runner.dtype import cpu_flags
from runner.models.linear import LinearKernel, OneDNNLinear, PackedLinear, RowCapped
from runner.models.linear_blocks import BlockLinear

FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")
# Rows a call takes through the bfloat16 kernel; past this the weight is streamed once
# per four rows and the target's kernel, blocked for many rows, is faster. One row to
# four through the default eagle head's matrices, cold: 470 / 520 / 670 us against
# oneDNN unsliced 700 / 750 / 800 (a /tmp timing). The float32 kernel takes any number.
MAX_ROWS = 4
LANES = 16

GemvFn = Callable[..., Any]  # specbudget_gemv_* through ctypes


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K / 2, 16, 2]: sixteen outputs' weights, two inputs a
    lane, in the order gemv_bf16.c loads them (N padded with zero rows)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // LANES) * LANES, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(-1, LANES, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16] in bfloat16: sixteen outputs' weights for one
    input, then the next, in the order gemv_f32.c loads them (N padded with zero
    rows)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // LANES) * LANES, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(-1, LANES, k).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class Gemv:
    """One of the two kernels: the activations' dtype it takes, the weights it can
    read, and how it wants them packed."""

    fn: GemvFn
    dtype: torch.dtype
    pack: Callable[[torch.Tensor], torch.Tensor]
    max_rows: int | None  # rows a call takes at most (None: any number)

    def reads(self, weight: torch.Tensor) -> bool:
        # gemv_bf16.c reads inputs in pairs
        pairs = self.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0
        return weight.dtype == self.dtype and weight.device.type == "cpu" and pairs


@dataclass(frozen=True)
class _Source:
    path: Path
    symbol: str
    needs: tuple[str, ...]  # CPU flags, as /proc/cpuinfo spells them


SOURCES = {
    torch.bfloat16: _Source(Path(__file__).with_name("gemv_bf16.c"), "specbudget_gemv_bf16",
                            ("avx512_bf16",)),
    torch.float32: _Source(Path(__file__).with_name("gemv_f32.c"), "specbudget_gemv_f32",
                           ("avx2", "fma")),
}


@functools.cache
def load(dtype: torch.dtype = torch.bfloat16) -> tuple[Gemv | None, str]:
    """(the kernel for `dtype`'s activations, "") or (None, why not): it needs its CPU
    flags (SOURCES) and a compiler."""
    source = SOURCES.get(dtype)
    if source is None:
        return None, f"no drafter gemv kernel takes {dtype}"
    missing = [flag for flag in source.needs if flag not in cpu_flags()]
    if missing:
        return None, f"the CPU has no {' or '.join(missing)}"
    lib, why = native.try_compiled(source.path, FLAGS, "drafter gemv kernel",
                                   "the drafter keeps the target's linear kernel")
    if lib is None:
        return None, why
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn = getattr(lib, source.symbol)
    fn.argtypes = [ptr, ptr, i64, i32, i32, i32, ptr, i64, ptr, i64, ptr]
    fn.restype = None
    if dtype == torch.bfloat16:
        return Gemv(fn, dtype, pack_pairs, MAX_ROWS), ""
    return Gemv(fn, dtype, pack_rows, None), ""


class _GemvPacked(PackedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 fallback: PackedLinear, gemv: Gemv) -> None:
        self.packed = gemv.pack(weight.detach())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = weight.shape
        self.fallback, self.gemv = fallback, gemv

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        self.gemv.fn(self.packed.data_ptr(), x.data_ptr(), x.stride(0), x.shape[0],
                     self.in_features, self.out_features, out.data_ptr(), out.stride(0),
                     None if residual is None else residual.data_ptr(),
                     0 if residual is None else residual.stride(0),
                     None if self.bias is None else self.bias.data_ptr())
        return out

    def _fits(self, x: torch.Tensor) -> bool:
        rows = self.gemv.max_rows
        return (x.dim() == 2 and (rows is None or x.shape[0] <= rows)
                and x.dtype == self.gemv.dtype and x.device.type == "cpu")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None) if self._fits(x) else self.fallback(x)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self._fits(x) and residual.dtype == self.gemv.dtype:
            return self._run(x, residual)
        return self.fallback.add(x, residual)


class DraftGemv(LinearKernel):
    """A gemv kernel for the calls it takes (`Gemv.max_rows`), `inner` for the rest
    (and for weights it cannot read)."""

    def __init__(self, inner: LinearKernel, gemv: Gemv) -> None:
        self.inner, self.gemv = inner, gemv
        if gemv.max_rows is None:
            self.name = f"f32 x bf16-weight gemv, any rows (else {inner.name})"
        else:
            self.name = f"bf16 gemv for at most {gemv.max_rows} rows, else {inner.name}"
        self.quantization = inner.quantization

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        fallback = self.inner.pack(weight, bias)
        if not self.gemv.reads(weight):
            return fallback
        return _GemvPacked(weight, bias, fallback, self.gemv)


def draft_kernel(target_kernel: LinearKernel, dtype: torch.dtype) -> LinearKernel:
    """The kernel a drafter's linear layers run with: the gemv for `dtype` for its
    small calls where this CPU and compiler have it, unsliced oneDNN for the rest where
    the target runs oneDNN, else the target's own kernel. Where the target runs weights
    from their GGUF blocks (runner/models/linear_blocks.py) a drafter's do too (a draft
    model made of them: a quarter of the bytes of the bfloat16-held gemv), and the
    others (a trained head's) are rounded to Q8_0 blocks and run from them as well
    (`BlockLinear.round_others`), where the kernel takes their shape, else they take
    the kernel above."""
    if isinstance(target_kernel, BlockLinear):
        return BlockLinear(draft_kernel(target_kernel.inner, dtype), round_others=True)
    if target_kernel.quantization is not None:
        return target_kernel
    onednn = isinstance(target_kernel, OneDNNLinear) or (
        isinstance(target_kernel, RowCapped) and isinstance(target_kernel.inner, OneDNNLinear))
    wide = OneDNNLinear(max_reduction=None) if onednn else target_kernel
    gemv, _ = load(dtype)
    return wide if gemv is None else DraftGemv(wide, gemv)
