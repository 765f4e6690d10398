"""Runner configuration (frozen) and the KV cache size it works out at start."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RunnerConfig:
    """Which model, where, and how much memory the KV cache may take.

    `model`: a Hugging Face-style directory, or None / "smollm2-135m" for the default.
    `attention_backend`: "torch", "triton", or "auto" (triton on CUDA, torch elsewhere).
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "auto"
    kv_cache_memory_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"RunnerConfig.dtype must be one of {', '.join(DTYPES)}, "
                             f"got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("RunnerConfig.attention_backend must be auto, torch or triton, "
                             f"got {self.attention_backend!r}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("RunnerConfig.kv_cache_memory_bytes must be > 0, got "
                             f"{self.kv_cache_memory_bytes}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

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
