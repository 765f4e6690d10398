"""Attention backends by name. Each entry is an import path, not an import: the base
module (backend.py) never imports its implementations, and the Triton one is loaded only
when asked for (vLLM's attention registry works the same way)."""

from __future__ import annotations

import importlib

from runner.attention.backend import AttentionBackend

BACKENDS = {
    "cpu": "runner.attention.cpu_paged:CpuPagedAttention",  # CPU runtime (compiled kernel)
    "torch": "runner.attention.torch_paged:TorchPagedAttention",  # any device; CPU fallback
    "triton": "runner.attention.triton_paged:TritonPagedAttention",  # CUDA
}


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend of the class registered as `name`."""
    path = BACKENDS.get(name)
    if path is None:
        raise ValueError(f"attention backend {name!r} is not supported; choose "
                         f"{' or '.join(BACKENDS)}")
    module, _, cls = path.partition(":")
    backend: AttentionBackend = getattr(importlib.import_module(module), cls)()
    return backend
