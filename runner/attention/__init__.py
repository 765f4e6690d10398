"""Paged attention: per-step metadata and the backends (torch on CPU, Triton on GPU)."""

from runner.attention.backend import AttentionBackend
from runner.attention.metadata import AttentionMetadata
from runner.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
