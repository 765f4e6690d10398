"""The attention backend interface and its registry."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from runner.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache, then attends over it.

    Shapes: query [T, num_heads, head_dim]; key/value [T, num_kv_heads, head_dim];
    key_cache/value_cache [num_blocks, block_size, num_kv_heads, head_dim].
    Returns [T, num_heads, head_dim]. Grouped-query attention: query head h reads
    KV head h // (num_heads // num_kv_heads).
    """

    name: str = "?"

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal paged attention for a mixed batch (prefill chunks and decodes)."""

    def write(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """This step's K/V rows into their cache slots, as `forward` writes them before
        it attends: a pass whose outputs nobody reads only writes
        (`LlamaAttention.write_kv`)."""
        num_tokens = meta.num_actual_tokens
        write_kv(key[:num_tokens], value[:num_tokens], key_cache, value_cache,
                 meta.slot_mapping[:num_tokens])


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter the step's K/V rows into their cache slots (flat slot = block*bs + off)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
