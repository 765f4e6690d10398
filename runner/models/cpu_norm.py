"""RMSNorm through one compiled call on the CPU (cpu_norm.c), for packed models.

A decode step runs 61 norms in the default model, each right after a weight matrix
has streamed through the caches. Cold like that, torch's bfloat16 `F.rms_norm` (seven
kernels and their dispatch) took ~43 us a call here, the compiled one ~12 (a /tmp
timing, 1 row of 576, after an 8,192 x 576 matrix-vector product): ~1.9 ms of a ~25 ms
step. The result is torch's formula rounded once, its sum of squares in a fixed order,
so a row's bits do not depend on the call; `tests/runner/test_cpu_norm.py` holds it to
torch's result and to itself alone and in a batch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from runner import native

logger = logging.getLogger("specbudget.runner")

SOURCE = Path(__file__).with_name("cpu_norm.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=gnu11", "-shared", "-fPIC")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}

NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    try:
        lib = native.compiled(SOURCE, FLAGS)
    except (OSError, subprocess.SubprocessError) as exc:
        why = native.failure(SOURCE, exc)
        logger.warning("CPU norm kernel unavailable (%s): torch's rms_norm serves", why)
        return None, why
    fn = lib.specbudget_rms_norm
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, i64, i64, ctypes.c_float]
    fn.restype = None
    return lib, ""


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def compiled_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`torch_rms_norm` through the compiled call, where the library is built and the
    tensors are ones it reads (CPU, float32 or bfloat16 alike, rows of contiguous
    elements); else torch's."""
    lib = load()[0]
    n = x.shape[-1]
    code = DTYPES.get(x.dtype)
    if (lib is None or code is None or w.dtype != x.dtype or x.device.type != "cpu"
            or x.stride(-1) != 1 or w.shape != (n,) or not w.is_contiguous()):
        return torch_rms_norm(x, w, eps)
    rows = x.reshape(-1, n)  # a view where x's rows are evenly spaced, else a copy
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.specbudget_rms_norm(code, rows.data_ptr(), rows.stride(0), w.data_ptr(),
                            out.data_ptr(), rows.shape[0], n, eps)
    return out


def norm_for(weight: torch.Tensor) -> NormFn:
    """The norm a packed model runs with this weight: the compiled one on the CPU for
    its dtypes where it builds, else torch's. Module-level functions, so a packed
    model still pickles."""
    if weight.device.type == "cpu" and weight.dtype in DTYPES and load()[0] is not None:
        return compiled_rms_norm
    return torch_rms_norm
