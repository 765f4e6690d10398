"""The project's C sources, compiled at first use and loaded through ctypes.

Each library is built with the machine's C compiler (`CC`, default `cc`) for this CPU
(`-march=native`) into `<cache>/kernels/`, named by a hash of its source, the flags,
the compiler's version and the CPU's flags, so a changed source or another machine
builds its own, and a second load finds the first one's file. Callers catch OSError
and SubprocessError and fall back to torch (runner/attention/cpu_kernel.py,
runner/models/cpu_ops.py).
"""

from __future__ import annotations

import ctypes
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

# Headers every source may include ("bf16.h", "exp_nonpositive.h"): on the include
# path, and in every library's hash, so a changed header rebuilds what includes it.
INCLUDE_DIR = Path(__file__).parent
HEADERS = (INCLUDE_DIR / "bf16.h", INCLUDE_DIR / "exp_nonpositive.h")


class NoCompilerError(OSError):
    """No C compiler on PATH."""


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, source: Path, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name, then renamed: a concurrent build (pytest workers,
    # two engines) never loads a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, f"-I{INCLUDE_DIR}", str(source), "-o", str(built),
                        "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        built.replace(target)


def compiled(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """`source` built with `flags` (once per source, flags, compiler and CPU) and
    loaded. Raises NoCompilerError, OSError or subprocess.SubprocessError."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise NoCompilerError(f"no C compiler {compiler!r} on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()[:1]
    key = hashlib.sha256(b"\0".join([source.read_bytes(),
                                     *(header.read_bytes() for header in HEADERS),
                                     " ".join(flags).encode(),
                                     "".join(version).encode(),
                                     cpu_flags().encode()])).hexdigest()[:16]
    target = default_cache_dir() / "kernels" / f"{source.stem}-{platform.machine()}-{key}.so"
    if not target.exists():
        _build(compiler, source, flags, target)
    return ctypes.CDLL(str(target))


def failure(source: Path, exc: Exception) -> str:
    """Why `compiled(source, ...)` failed, in one line a warning can carry."""
    if isinstance(exc, NoCompilerError):
        return str(exc)
    detail = getattr(exc, "stderr", "") or str(exc)
    return f"building {source.name} failed: {detail.strip()[:500]}"


def try_compiled(source: Path, flags: tuple[str, ...], what: str,
                 fallback: str) -> tuple[ctypes.CDLL | None, str]:
    """(`compiled(source, flags)`, "") or (None, why not), a warning then saying that
    `what` is unavailable and what serves instead (`fallback`)."""
    try:
        return compiled(source, flags), ""
    except (OSError, subprocess.SubprocessError) as exc:
        why = failure(source, exc)
        logger.warning("%s unavailable (%s): %s", what, why, fallback)
        return None, why
