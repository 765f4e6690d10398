"""Paged attention: per-step metadata and the backends (torch on CPU, Triton on GPU)."""

from runner.attention.backend import AttentionBackend, get_attention_backend
from runner.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
