"""Paged attention in plain torch: the CPU runtime path and the Triton kernel's reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.attention.backend import AttentionBackend, write_kv
from runner.attention.metadata import AttentionMetadata


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One request's first `seq_len` K or V rows: [seq_len, num_kv_heads, head_dim]."""
    return cache[block_ids].flatten(0, 1)[:seq_len]


class TorchPagedAttention(AttentionBackend):
    """One scaled-dot-product call per request over its gathered cache blocks."""

    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_tokens = meta.num_actual_tokens
        write_kv(key[:num_tokens], value[:num_tokens], key_cache, value_cache,
                 meta.slot_mapping[:num_tokens])
        out = torch.empty_like(query[:num_tokens])
        block_size = key_cache.shape[1]
        group = query.shape[1] // key.shape[1]
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(meta.num_reqs):
            q_start, q_end, seq_len = starts[i], starts[i + 1], lens[i]
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_table[i, :num_blocks].long()
            k = gather_kv(key_cache, blocks, seq_len).repeat_interleave(group, dim=1)
            v = gather_kv(value_cache, blocks, seq_len).repeat_interleave(group, dim=1)
            q = query[q_start:q_end]
            # Query j sits at position seq_len - num_q + j: it sees keys 0..that position.
            num_q = q_end - q_start
            q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=mask, scale=scale)
            out[q_start:q_end] = attn.transpose(0, 1)
        return out
