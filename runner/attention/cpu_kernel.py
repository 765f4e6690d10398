"""The CPU attention kernel (cpu_paged.c): built at first use, loaded through ctypes.

The torch path (torch_paged.py) keeps a row's result independent of its batch by
shaping BLAS calls (padding to minimum sizes, keys in chunks of 128, float32 copies of
every key), and on this CPU that shaping is most of the cost: in a 64-request decode
step of the default model, attention took half the step. The kernel gets the same
guarantee by construction (each row's arithmetic runs in an order fixed by key index:
cpu_paged.c's header) and reads each key once per tile of rows, in the cache's own
dtype.

The library is compiled with the machine's C compiler (`CC`, default `cc`) for this
CPU (`-march=native`) into `<cache>/kernels/`, named by a hash of the source, the flags,
the compiler's version and the CPU's flags, so a changed source or another machine
builds its own. Where no compiler works, `load()` returns None with the reason, and
the runner's "auto" backend falls back to the torch path (`runner/config.py`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from runner.model_prep import default_cache_dir

logger = logging.getLogger("specbudget.runner")

SOURCE = Path(__file__).with_name("cpu_paged.c")
# -ffp-contract=off: only the fmaf calls the source writes are fused, so vector and
# scalar code (a loop's remainder) compute the same bits.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=gnu11",
         "-shared", "-fPIC")
KERNEL_DTYPES = {"float32": 0, "bfloat16": 1}  # torch dtype name -> the kernel's code


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name, then renamed: a concurrent build (pytest workers,
    # two engines) never loads a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        built.replace(target)


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        return _unavailable(f"no C compiler {compiler!r} on PATH")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
        key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(),
                                         "".join(version).encode(),
                                         _cpu_flags().encode()])).hexdigest()[:16]
        target = default_cache_dir() / "kernels" / f"cpu_paged-{platform.machine()}-{key}.so"
        if not target.exists():
            _build(compiler, target)
        # torch is imported first (it is the caller), so the library's libgomp.so.1 is
        # the one torch already loaded: one OpenMP thread pool, not two.
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return _unavailable(f"building {SOURCE.name} failed: {detail.strip()[:500]}")
    fn = lib.specbudget_paged_attention
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, ptr, ptr, i64, i32, ptr, ptr, i32, i64,
                   i64, i32, i32, i32, i32, ctypes.c_float]
    fn.restype = ctypes.c_int
    return lib, ""


def _unavailable(why: str) -> tuple[None, str]:
    logger.warning("CPU attention kernel unavailable (%s): the torch path serves", why)
    return None, why


def available() -> bool:
    return load()[0] is not None
