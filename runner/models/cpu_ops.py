"""A decoder layer's small ops through one compiled call each on the CPU (cpu_ops.c):
RMSNorm for packed models, and the rotary embedding.

A decode step runs 61 norms and 30 rotations in the default model, each right after
a weight matrix has streamed through the caches. Cold like that, torch's bfloat16
`F.rms_norm` (seven kernels and their dispatch) took ~43 us a call here, the compiled
one ~12 (a /tmp timing, 1 row of 576, after an 8,192 x 576 matrix-vector product):
~1.9 ms of a ~25 ms step; `Rotary` (a concatenation, a product and an addcmul) ~23 us
in place, the compiled one ~10. The norm is torch's formula rounded once with its
sum of squares in a fixed order, so a row's bits do not depend on the call; the
rotation is `Rotary`'s arithmetic bit for bit (so the compiled and torch paths may
meet in one model: a write-only pass and a full one give the same keys).
`tests/runner/test_cpu_ops.py` holds both to torch and to themselves alone and in a
batch.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from runner import native

SOURCE = Path(__file__).with_name("cpu_ops.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=gnu11", "-shared", "-fPIC")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}

# Past this many tokens (a prompt chunk) the rotation runs in torch, whose kernels use
# both cores: bfloat16, warm, the compiled call takes 5.6 / 37.5 / 229 us at 1 / 80 /
# 512 tokens against torch's 7.7 / 64.8 / 156 (a /tmp timing). Either gives the same
# bits, so the switch changes no result.
ROPE_MAX_TOKENS = 128


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    lib, why = native.try_compiled(SOURCE, FLAGS, "CPU layer ops",
                                   "torch's norm and rotation serve")
    if lib is None:
        return None, why
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.specbudget_rms_norm.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, i64, i64,
                                        ctypes.c_float]
    lib.specbudget_rms_norm.restype = None
    lib.specbudget_rope.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64, i64, i64]
    lib.specbudget_rope.restype = None
    return lib, ""


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def compiled_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`torch_rms_norm` through the compiled call, where the library is built and the
    tensors are ones it reads (CPU, float32 or bfloat16 alike, rows of contiguous
    elements); else torch's. `CompiledNorm` made for this one call."""
    packed = norm_for(w, eps)
    return packed(x) if packed is not None else torch_rms_norm(x, w, eps)


class CompiledNorm:
    """`compiled_rms_norm` bound to one weight, what a packed RMSNorm runs: the weight's
    checks made once, a call's only on its input (a decode step runs 61 norms of one
    row, and the unbound checks cost 9 of a call's ~11 us). Holds no library handle,
    so a packed model still pickles."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps
        self.width, self.dtype, self.code = weight.shape[0], weight.dtype, DTYPES[weight.dtype]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lib, n = load()[0], self.width
        if (lib is None or x.dtype is not self.dtype or not x.is_cpu or x.shape[-1] != n
                or x.stride(-1) != 1):
            return torch_rms_norm(x, self.weight, self.eps)
        rows = x.reshape(-1, n)  # a view where x's rows are evenly spaced, else a copy
        out = torch.empty(*x.shape, dtype=x.dtype)
        lib.specbudget_rms_norm(self.code, rows.data_ptr(), rows.stride(0),
                                self.weight.data_ptr(), out.data_ptr(), rows.shape[0], n,
                                self.eps)
        return out


def norm_for(weight: torch.Tensor, eps: float) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The norm a packed model runs with this weight: the compiled one on the CPU for
    its dtypes where it builds (a contiguous vector), else None (torch's)."""
    if (weight.is_cpu and weight.dtype in DTYPES and weight.dim() == 1
            and weight.is_contiguous() and load()[0] is not None):
        return CompiledNorm(weight, eps)
    return None


def rope_tables_fit(cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
    """Whether the compiled rotation reads these tables ([T, 1, D] contiguous on the CPU,
    one dtype it takes, T at most ROPE_MAX_TOKENS, D even) where the library is built:
    checked once a pass (`Rotary`), not once a layer."""
    if load()[0] is None or cos.dtype not in DTYPES or cos.dim() != 3:
        return False
    tokens, one, dim = cos.shape
    return (one == 1 and tokens <= ROPE_MAX_TOKENS and not dim % 2 and cos.is_cpu
            and signed_sin.dtype is cos.dtype and signed_sin.is_cpu
            and signed_sin.shape == cos.shape and cos.is_contiguous()
            and signed_sin.is_contiguous())


def rope_with_tables(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
                     ) -> torch.Tensor | None:
    """`compiled_rope` for tables `rope_tables_fit` accepted: only x is checked (heads
    contiguous, the tables' tokens, dimension and dtype; no gradient wanted through
    it), else None."""
    lib, (tokens, _, dim) = load()[0], cos.shape
    if (lib is None or x.dim() != 3 or x.dtype is not cos.dtype or not x.is_cpu
            or x.shape[0] != tokens or x.shape[2] != dim or x.stride(2) != 1
            or x.stride(1) != dim or (x.requires_grad and torch.is_grad_enabled())):
        return None
    out = torch.empty(*x.shape, dtype=x.dtype)
    lib.specbudget_rope(DTYPES[x.dtype], x.data_ptr(), x.stride(0), cos.data_ptr(),
                        signed_sin.data_ptr(), out.data_ptr(), tokens, x.shape[1], dim)
    return out


def compiled_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
                  ) -> torch.Tensor | None:
    """`Rotary(cos, signed_sin)(x)` through the compiled call, or None where torch's
    should run it (no library; not CPU float32/bfloat16 alike; heads not contiguous;
    tables not [T, 1, D] contiguous; a gradient wanted through x; more than
    ROPE_MAX_TOKENS tokens)."""
    if not rope_tables_fit(cos, signed_sin):
        return None
    return rope_with_tables(x, cos, signed_sin)
