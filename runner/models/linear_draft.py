"""A drafter's linear layers: a bfloat16 kernel for calls of a few rows (gemv_bf16.c).

A drafter proposes; the target verifies. So a drafter's rows need not have the bits
they would have in a call of another size, and its calls need not go through the
row-invariant kernel the target must use (runner/models/kernel_select.py). They are
also small: an eagle head's passes multiply a row or a few by six matrices of 0.6-9.4
MB (fc for context rows, q/k/v, o, gate/up, down, the draft vocabulary's LM head),
each cold after the target's pass, and oneDNN pays a fixed cost per call that such a
matrix cannot hide, more so where the row-invariant kernel slices a reduction past
768 inputs into calls of its own. One row through the default eagle head's six
matrices, each cold (a /tmp timing, 2 threads, Intel AMX machine): the target's
kernel ~950 us, oneDNN unsliced ~700, this kernel ~470.

Calls of more than `MAX_ROWS` rows (a verification's rows in an eagle head's first
pass, a prefill's context rows, 16 requests' steps) take oneDNN where the target runs
it, in one call however wide the reduction (the row-invariant kernel's slices and row
cap are for the target), else the target's own kernel. The head's six matrices at
5 / 7 / 9 rows, each cold: the target's kernel ~1,510 us, unsliced ~1,230, this kernel
1,640-2,050 (a /tmp timing).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runner import native
from runner.dtype import cpu_flags
from runner.models.linear import LinearKernel, OneDNNLinear, PackedLinear, RowCapped

SOURCE = Path(__file__).with_name("gemv_bf16.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")
# Rows a call takes through the kernel; past this the weight is streamed once per
# four rows and the target's kernel, blocked for many rows, is faster. One row to four
# through the default eagle head's matrices, cold: 470 / 520 / 670 us against oneDNN
# unsliced 700 / 750 / 800 (a /tmp timing).
MAX_ROWS = 4
LANES = 16

GemvFn = Callable[..., Any]  # specbudget_gemv_bf16 through ctypes


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not): it needs AVX512_BF16 and a compiler."""
    if "avx512_bf16" not in cpu_flags():
        return None, "the CPU has no avx512_bf16"
    lib, why = native.try_compiled(SOURCE, FLAGS, "drafter gemv kernel",
                                   "the drafter keeps the target's linear kernel")
    if lib is None:
        return None, why
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn = lib.specbudget_gemv_bf16
    fn.argtypes = [ptr, ptr, i64, i32, i32, i32, ptr, i64, ptr, i64, ptr]
    fn.restype = None
    return lib, ""


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K / 2, 16, 2]: sixteen outputs' weights, two inputs a
    lane, in the order the kernel loads them (N padded with zero rows)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // LANES) * LANES, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(-1, LANES, k // 2, 2).permute(0, 2, 1, 3).contiguous()


class _GemvPacked(PackedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 fallback: PackedLinear, fn: GemvFn) -> None:
        self.pairs = pack_pairs(weight.detach())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = weight.shape
        self.fallback, self._fn = fallback, fn

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        self._fn(self.pairs.data_ptr(), x.data_ptr(), x.stride(0), x.shape[0],
                 self.in_features, self.out_features, out.data_ptr(), out.stride(0),
                 None if residual is None else residual.data_ptr(),
                 0 if residual is None else residual.stride(0),
                 None if self.bias is None else self.bias.data_ptr())
        return out

    def _fits(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16
                and x.device.type == "cpu")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None) if self._fits(x) else self.fallback(x)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self._fits(x) and residual.dtype == torch.bfloat16:
            return self._run(x, residual)
        return self.fallback.add(x, residual)


class DraftGemv(LinearKernel):
    """The bfloat16 kernel for calls of up to `MAX_ROWS` rows, `inner` for the rest."""

    def __init__(self, inner: LinearKernel, fn: GemvFn) -> None:
        self.inner, self._fn = inner, fn
        self.name = f"bf16 gemv for at most {MAX_ROWS} rows, else {inner.name}"
        self.quantization = inner.quantization

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        fallback = self.inner.pack(weight, bias)
        if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu"
                or weight.shape[1] % 2):
            return fallback
        return _GemvPacked(weight, bias, fallback, self._fn)


def draft_kernel(target_kernel: LinearKernel, dtype: torch.dtype) -> LinearKernel:
    """The kernel a drafter's linear layers run with: the bfloat16 gemv for its small
    calls where this CPU and compiler have it, unsliced oneDNN for the rest where the
    target runs oneDNN, else the target's own kernel."""
    if target_kernel.quantization is not None:
        return target_kernel
    onednn = isinstance(target_kernel, OneDNNLinear) or (
        isinstance(target_kernel, RowCapped) and isinstance(target_kernel.inner, OneDNNLinear))
    wide = OneDNNLinear(max_reduction=None) if onednn else target_kernel
    lib, _ = load() if dtype == torch.bfloat16 else (None, "")
    return wide if lib is None else DraftGemv(wide, lib.specbudget_gemv_bf16)
