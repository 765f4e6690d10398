"""`dtype="auto"`: bfloat16 where the hardware computes it natively, float32 elsewhere.

bfloat16 halves the bytes every forward pass reads (this model's decode step is bound
by reading its weights) and, where the CPU has bf16 dot-product instructions
(AVX512_BF16 or AMX-BF16), its matmuls cost barely more for five rows than for one.
Without them, bf16 matmuls are emulated and run slower than float32 for more than a
row or two, so "auto" keeps float32 there.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

# CPU flags (as /proc/cpuinfo spells them) that make bf16 matmuls native.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags; empty where /proc/cpuinfo is not readable."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a run uses and why (printed at start, shown in /health)."""

    dtype: str
    reason: str


def resolve_dtype(requested: str, device: str,
                  flags: frozenset[str] | None = None) -> DtypeChoice:
    """`requested` as given by the user; "auto" picks per device and CPU."""
    if requested != "auto":
        return DtypeChoice(requested, "set by the user")
    if device.startswith("cuda"):
        return DtypeChoice("bfloat16", "auto: CUDA computes bfloat16 natively")
    flags = cpu_flags() if flags is None else flags
    native = [flag for flag in BF16_CPU_FLAGS if flag in flags]
    if native:
        return DtypeChoice("bfloat16", f"auto: the CPU has {'/'.join(native)}")
    return DtypeChoice("float32", "auto: the CPU has no native bfloat16 "
                       f"({' or '.join(BF16_CPU_FLAGS)}), so float32 is faster")
