"""A float32 model's linear layers held as the GGUF blocks they were dequantized from.

The default model ships as a Q4_1 GGUF (its embedding, which is also its LM head, as
Q8_0) and runs dequantized to float32 (runner/model_prep.py). Every weight is then
d * q + m for a 4-bit code q and a scale d and minimum m shared by 32 inputs (Q8_0:
d * q, q 8-bit), so a float32 decode step streams 6.4x (Q8_0: 3.8x) the bytes the
blocks take, and on a CPU bound by its memory that read is the step.

`BlockLinear` finds those blocks in a float32 weight (`find_blocks`: every weight must
be rebuilt bit for bit, else the layer keeps the inner kernel) and runs the layer on
gemv_blocks.c, which rebuilds each weight as the conversion did and sums in float32,
each output over its inputs in order: the model is the float32 model, only summed in
another order than oneDNN's, and each row's bits do not depend on what shares the call,
which the target's kernel choice checks (runner/models/kernel_select.py). AVX2, FMA and
F16C.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner import native
from runner.dtype import cpu_flags
from runner.models.linear import LinearKernel, PackedLinear

SOURCE = Path(__file__).with_name("gemv_blocks.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")
NEEDS = ("avx2", "fma", "f16c")
GROUP = 32  # inputs sharing a scale, in both formats
CHUNK = 64  # inputs gemv_blocks.c rebuilds at a time: a weight's inputs are a multiple
LANES = 16  # outputs gemv_blocks.c computes together
RUN = 6 * LANES  # outputs it may take at once: a packed weight's are a multiple
# Code width -> the code range a block may use.
CODE_RANGE = {4: (0, 15), 8: (-127, 127)}


@dataclass(frozen=True)
class Blocks:
    """A weight [N, K] as codes [N, K] (uint8 0-15, or int8), scales and minimums
    [N, K / 32] (float32, each a float16 value; minimums zero for 8-bit codes): weight =
    scale * code + minimum, in float32, the product rounded first."""

    bits: int
    codes: np.ndarray
    scales: np.ndarray
    minimums: np.ndarray


def find_blocks(weight: torch.Tensor) -> Blocks | None:
    """`weight` [N, K] (float32, K a multiple of 64) as Q4_1 or Q8_0 blocks along its
    inputs, whichever rebuilds every weight bit for bit (the narrower first; a zero's
    sign aside, which no sum from +0 can see), else None (also where the kernel is not
    built here). gemv_blocks.c's `specbudget_find_blocks` does the search: the scale from
    each group's extreme, to within a float16 step, each candidate checked by
    rebuilding the group."""
    lib, _ = load()
    if lib is None or not _takes(weight):
        return None
    n, k = weight.shape
    flat = weight.detach().contiguous()
    groups = n * k // GROUP
    for bits in (4, 8):
        codes = np.empty((n, k), np.uint8 if bits == 4 else np.int8)
        scales = np.empty((n, k // GROUP), np.float32)
        minimums = np.empty((n, k // GROUP), np.float32)
        if lib.find(bits, flat.data_ptr(), groups, codes.ctypes.data, scales.ctypes.data,
                    minimums.ctypes.data) == 0:
            return Blocks(bits, codes, scales, minimums)
    return None


def quantized(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """`weight` [N, K] quantized to Q4_1 (bits=4) or Q8_0 (8) blocks as llama.cpp's
    reference quantizer does, and dequantized to float32: a weight `find_blocks` finds
    (for tests and the row-invariance probe)."""
    n, k = weight.shape
    groups = weight.detach().float().cpu().numpy().reshape(-1, GROUP)
    lowest, highest = CODE_RANGE[bits]
    if bits == 4:
        low = groups.min(axis=1)
        scale = (groups.max(axis=1) - low) / highest
        minimum = low.astype(np.float16).astype(np.float32)
    else:
        scale = np.abs(groups).max(axis=1) / highest
        minimum = np.zeros(len(groups), np.float32)
    inverse = np.where(scale > 0, 1 / np.where(scale > 0, scale, 1), 0)[:, None]
    code = np.clip(np.rint((groups - (low[:, None] if bits == 4 else 0)) * inverse),
                   lowest, highest).astype(np.float32)
    out = scale.astype(np.float16).astype(np.float32)[:, None] * code
    if bits == 4:
        out = out + minimum[:, None]
    return torch.from_numpy(out.reshape(n, k))


def _lanes(array: np.ndarray) -> np.ndarray:
    """[N, C] -> [N' / 16, C, 16]: sixteen outputs' entries for one column, then the
    next (N padded with zeros to N', a multiple of `RUN`)."""
    n, c = array.shape
    padded = np.zeros((-(-n // RUN) * RUN, c), array.dtype)
    padded[:n] = array
    return np.ascontiguousarray(padded.reshape(-1, LANES, c).transpose(0, 2, 1))


def pack_codes(blocks: Blocks) -> np.ndarray:
    """The codes as gemv_blocks.c reads them: 8-bit [N / 16, K, 16] bytes; 4-bit
    [N / 16, K / 8, 16] 32-bit words, word l holding output l's codes for 8 inputs in a
    row, the first in its lowest nibble."""
    lanes = _lanes(blocks.codes)
    if blocks.bits == 8:
        return lanes.view(np.uint8)
    blocks_n, k, _ = lanes.shape
    nibbles = lanes.reshape(blocks_n, k // 8, 8, LANES).transpose(0, 1, 3, 2).astype(np.uint32)
    words = np.zeros((blocks_n, k // 8, LANES), np.uint32)
    for i in range(8):
        words |= nibbles[..., i] << (4 * i)
    return words.view(np.uint8)


@dataclass(frozen=True)
class _Lib:
    gemv: Any  # specbudget_gemv_blocks through ctypes
    find: Any  # specbudget_find_blocks


@functools.cache
def load() -> tuple[_Lib | None, str]:
    """(gemv_blocks.c's functions, "") or (None, why not)."""
    missing = [flag for flag in NEEDS if flag not in cpu_flags()]
    if missing:
        return None, f"the CPU has no {' or '.join(missing)}"
    lib, why = native.try_compiled(SOURCE, FLAGS, "GGUF-block linear kernel",
                                   "float32 models keep the oneDNN kernel")
    if lib is None:
        return None, why
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    gemv, find = lib.specbudget_gemv_blocks, lib.specbudget_find_blocks
    gemv.argtypes = [i32, ptr, ptr, ptr, ptr, i64, i32, i32, i32, ptr, i64, ptr, i64, ptr]
    gemv.restype = i32
    find.argtypes = [i32, ptr, i64, ptr, ptr, ptr]
    find.restype = i64
    return _Lib(gemv, find), ""


class _BlocksPacked(PackedLinear):
    def __init__(self, blocks: Blocks, bias: torch.Tensor | None, inner: LinearKernel,
                 lib: _Lib) -> None:
        self.bits, self.gemv, self.inner = blocks.bits, lib.gemv, inner
        self.out_features, self.in_features = blocks.codes.shape
        self.codes = torch.from_numpy(pack_codes(blocks))
        # float16 holds them exactly: the format stores them so (`find_blocks`)
        self.scales = torch.from_numpy(_lanes(blocks.scales.astype(np.float16)))
        self.minimums = (torch.from_numpy(_lanes(blocks.minimums.astype(np.float16)))
                         if blocks.bits == 4 else None)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._fallback: PackedLinear | None = None

    def fallback(self) -> PackedLinear:
        """The inner kernel on the rebuilt weight, packed at the first call that does
        not fit (not 2-D float32 on the CPU): the model never sends one, so it is
        never held."""
        if self._fallback is None:
            self._fallback = self.inner.pack(self.weight(), self.bias)
        return self._fallback

    def weight(self) -> torch.Tensor:
        """The float32 weight [N, K], rebuilt by the kernel (identity rows in)."""
        return self._run(torch.eye(self.in_features), None, bias=False).T.contiguous()

    def _fits(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.dtype is torch.float32 and x.is_cpu
                and x.shape[1] == self.in_features)

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None,
             bias: bool = True) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        failed = self.gemv(self.bits, self.codes.data_ptr(), self.scales.data_ptr(),
                           None if self.minimums is None else self.minimums.data_ptr(),
                           x.data_ptr(), x.stride(0), x.shape[0],
                           self.in_features, self.out_features, out.data_ptr(), out.stride(0),
                           None if residual is None else residual.data_ptr(),
                           0 if residual is None else residual.stride(0),
                           None if self.bias is None or not bias else self.bias.data_ptr())
        if failed:
            raise MemoryError("gemv_blocks.c could not allocate a thread's block buffer")
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None) if self._fits(x) else self.fallback()(x)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # the kernel reads the residual's rows by pointer: its shape is checked here
        if self._fits(x) and residual.dtype == torch.float32 and tuple(residual.shape) == (
                x.shape[0], self.out_features):
            return self._run(x, residual)
        return self.fallback().add(x, residual)


class BlockLinear(LinearKernel):
    """gemv_blocks.c for a float32 weight made of Q4_1 or Q8_0 blocks, `inner` for any
    other weight (and for a call the kernel does not take).

    `round_others` (a drafter's kernel, runner/models/linear_draft.py): any other
    float32 weight whose inputs the kernel takes is rounded to Q8_0 blocks and runs
    from them too, instead of on `inner`. A drafter proposes and the target verifies,
    so its weights need not be the float32 ones (the gemv it would take holds them in
    bfloat16 anyway), and Q8_0 streams 1.06 bytes a weight where bfloat16 streams 2:
    a trained eagle head's six matrices, ~20 MB a pass held in bfloat16, are ~10.6 MB,
    each read cold after the target's pass."""

    def __init__(self, inner: LinearKernel, round_others: bool = False) -> None:
        self.inner, self.round_others = inner, round_others
        rounded = ", others rounded to q8_0 blocks" if round_others else ""
        self.name = f"gguf blocks{rounded}, float32 sums (else {inner.name})"
        self.quantization = inner.quantization

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        lib, blocks = load()[0], find_blocks(weight)  # no blocks where no kernel
        if lib is not None and blocks is None and self.round_others:
            blocks = find_blocks(quantized(weight, 8)) if _takes(weight) else None
        if lib is None or blocks is None:
            return self.inner.pack(weight, bias)
        return _BlocksPacked(blocks, bias, self.inner, lib)

    def probe_weights(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if weight.dtype != torch.float32 or weight.shape[1] % CHUNK:
            return (weight,)
        return (weight, quantized(weight, 4), quantized(weight, 8))


def _takes(weight: torch.Tensor) -> bool:
    """Whether the kernel takes a weight of this shape and kind, blocks or not: 2-D
    float32 on the CPU, its inputs a multiple of `CHUNK`."""
    return (weight.dim() == 2 and weight.dtype == torch.float32 and not weight.shape[1] % CHUNK
            and weight.device.type == "cpu")


def available() -> bool:
    return load()[0] is not None
