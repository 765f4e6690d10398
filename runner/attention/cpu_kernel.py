"""The CPU attention kernel (cpu_paged.c): built at first use, loaded through ctypes.

The torch path (torch_paged.py) keeps a row's result independent of its batch by
shaping BLAS calls (padding to minimum sizes, keys in chunks of 128, float32 copies of
every key), and on this CPU that shaping is most of the cost: in a 64-request decode
step of the default model, attention took half the step. The kernel gets the same
guarantee by construction (each row's arithmetic runs in an order fixed by key index:
cpu_paged.c's header) and reads each key once per tile of rows, in the cache's own
dtype.

The library is compiled at first use (runner/native.py: the machine's C compiler, for
this CPU, kept in the model cache by a hash of source, flags, compiler and CPU). Where
no compiler works, `load()` returns None with the reason, and
the runner's "auto" backend falls back to the torch path (`runner/config.py`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from runner import native

SOURCE = Path(__file__).with_name("cpu_paged.c")
# -ffp-contract=off: only the fmaf calls the source writes are fused, so vector and
# scalar code (a loop's remainder) compute the same bits.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=gnu11",
         "-shared", "-fPIC")
KERNEL_DTYPES = {"float32": 0, "bfloat16": 1}  # torch dtype name -> the kernel's code


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    # torch is imported first (it is the caller), so the library's libgomp.so.1 is the
    # one torch already loaded: one OpenMP thread pool, not two.
    lib, why = native.try_compiled(SOURCE, FLAGS, "CPU attention kernel",
                                   "the torch path serves")
    if lib is None:
        return None, why
    return bind(lib), ""


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with the kernel's argument types declared (a build of SOURCE)."""
    fn = lib.specbudget_paged_attention
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64,
                   i32, ptr, ptr, ptr, i32, i64, i64, i32, i32, i32, i32, ctypes.c_float]
    fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    return load()[0] is not None
