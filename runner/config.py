"""Runner configuration (frozen) and the KV cache size it works out at start."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.dtype import DtypeChoice, resolve_dtype

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RunnerConfig:
    """Which model, where, and how much memory the KV cache may take.

    `model`: a Hugging Face-style directory, or None / "smollm2-135m" for the default.
    `attention_backend`: "torch", "triton", or "auto" (triton on CUDA, torch elsewhere).
    `dtype`: "auto" (bfloat16 where the hardware computes it natively, else float32;
    runner/dtype.py), or one of DTYPES.
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    attention_backend: str = "auto"
    kv_cache_memory_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"RunnerConfig.dtype must be auto or one of "
                             f"{', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("RunnerConfig.attention_backend must be auto, torch or triton, "
                             f"got {self.attention_backend!r}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("RunnerConfig.kv_cache_memory_bytes must be > 0, got "
                             f"{self.kv_cache_memory_bytes}")

    @property
    def dtype_choice(self) -> DtypeChoice:
        """The dtype this run uses ("auto" resolved) and why."""
        return resolve_dtype(self.dtype, self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_choice.dtype]

    @property
    def backend_name(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "torch"


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    """K and V for one block of every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element
