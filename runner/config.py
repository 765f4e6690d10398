"""Runner configuration (frozen) and the KV cache size it works out at start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.dtype import DtypeChoice, resolve_dtype

if TYPE_CHECKING:
    import torch

# By name: the API process reads this config and must not pay for importing torch.
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class RunnerConfig:
    """Which model, where, and how much memory the KV cache may take.

    `model`: a Hugging Face-style directory, or None / "smollm2-135m" for the default.
    `attention_backend`: "cpu", "torch", "triton", or "auto": triton on CUDA; on the
    CPU the compiled kernel (runner/attention/cpu_kernel.py) for float32 and bfloat16
    where a C compiler builds it, else torch (the plain-torch path, any device).
    `dtype`: "auto" (bfloat16 where the hardware computes it natively, else float32;
    runner/dtype.py), or one of DTYPES.
    `quantization`: None, or "int8" (CPU: int8 weights, per-row int8 activations,
    float32 in and out; runner/models/linear_int8.py).
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    attention_backend: str = "auto"
    kv_cache_memory_bytes: int = 256 << 20
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"RunnerConfig.dtype must be auto or one of "
                             f"{', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError("RunnerConfig.attention_backend must be auto, cpu, torch or "
                             f"triton, got {self.attention_backend!r}")
        if self.attention_backend == "cpu" and not self.device.startswith("cpu"):
            raise ValueError("RunnerConfig.attention_backend=cpu runs on the CPU only, got "
                             f"device {self.device!r}")
        if self.quantization not in (None, "int8"):
            raise ValueError("RunnerConfig.quantization must be None or int8, got "
                             f"{self.quantization!r}")
        if self.quantization == "int8" and not self.device.startswith("cpu"):
            raise ValueError("RunnerConfig.quantization=int8 runs on the CPU only (fbgemm), "
                             f"got device {self.device!r}")
        if self.quantization == "int8" and self.dtype not in ("auto", "float32"):
            raise ValueError("RunnerConfig.quantization=int8 takes float32 activations: "
                             f"dtype must be auto or float32, got {self.dtype!r}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("RunnerConfig.kv_cache_memory_bytes must be > 0, got "
                             f"{self.kv_cache_memory_bytes}")

    @property
    def dtype_choice(self) -> DtypeChoice:
        """The dtype this run uses ("auto" resolved) and why."""
        if self.quantization == "int8" and self.dtype == "auto":
            return DtypeChoice("float32", "auto: int8 weights take float32 activations")
        return resolve_dtype(self.dtype, self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype_choice.dtype)
        return dtype

    @property
    def backend_name(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        if self.device.startswith("cuda"):
            return "triton"
        from runner.attention.cpu_kernel import KERNEL_DTYPES, available

        return "cpu" if self.dtype_choice.dtype in KERNEL_DTYPES and available() else "torch"


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    """K and V for one block of every layer."""
    import torch

    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element
