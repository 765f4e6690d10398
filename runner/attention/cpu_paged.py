"""Paged attention on the CPU through the compiled kernel (cpu_kernel.py, cpu_paged.c).

The same contract as the torch path (a row's result the same alone, in any batch and in
any chunking of its prompt) from a kernel whose per-row arithmetic is fixed, not from
shaping BLAS calls: one call per layer, keys read once per tile of query rows in the
cache's dtype, no float32 copies of the keys, no padding.
"""

from __future__ import annotations

import ctypes

import torch

from runner.attention.backend import AttentionBackend
from runner.attention.cpu_kernel import KERNEL_DTYPES, load
from runner.attention.metadata import AttentionMetadata


class CpuPagedAttention(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        lib, why = load()
        if lib is None:
            raise RuntimeError(f"the cpu attention backend needs its kernel: {why}")
        self._fn = lib.specbudget_paged_attention
        # The last metadata checked: every layer of a pass shares it (runners build a
        # fresh one per pass and never change it, as the torch path's plans assume).
        self._checked: AttentionMetadata | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        code = _check_tensors(query, key_cache, value_cache)  # before anything is written
        if meta is not self._checked:
            _check_metadata(meta)
            self._checked = meta
        num_tokens = meta.num_actual_tokens
        query, key, value = _rows(query, num_tokens), _rows(key, num_tokens), _rows(
            value, num_tokens)
        if key.dtype != key_cache.dtype or value.dtype != key_cache.dtype:
            raise ValueError(f"the cpu attention backend writes keys and values of the "
                             f"caches' dtype ({key_cache.dtype}), got {key.dtype}, "
                             f"{value.dtype}")
        out = torch.empty(num_tokens, query.shape[1], query.shape[2], dtype=query.dtype)
        table = meta.block_table
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        if key.shape[1:] != (num_kv_heads, head_dim) or value.shape[1:] != key.shape[1:]:
            raise ValueError(f"keys and values of shape [T, {num_kv_heads}, {head_dim}] "
                             f"go into these caches, got {tuple(key.shape)}, "
                             f"{tuple(value.shape)}")
        size = key.element_size()
        tree = meta.tree_prefix
        # The kernel writes this step's K/V into the caches before it attends (the
        # same bytes as `write`, in the call that reads them).
        status = self._fn(code, query.data_ptr(), query.stride(0),
                          key.data_ptr(), key.stride(0) * size,
                          value.data_ptr(), value.stride(0) * size,
                          meta.slot_mapping.data_ptr(),
                          key_cache.data_ptr(), value_cache.data_ptr(),
                          out.data_ptr(), table.data_ptr(), table.stride(0), table.shape[1],
                          meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
                          tree.data_ptr() if tree is not None else None, meta.num_reqs,
                          num_tokens, num_blocks, query.shape[1], num_kv_heads, head_dim,
                          block_size, ctypes.c_float(scale))
        if status == -2:
            raise ValueError("attention metadata out of range: a request's rows, sequence "
                             "length or block ids do not fit the query rows, its block "
                             "table or the KV caches, a slot of slot_mapping lies "
                             "outside the caches, or a tree row's prefix is not in "
                             "[1, its own position]")
        if status != 0:
            raise MemoryError("cpu attention kernel could not allocate its scratch")
        return out


def _rows(t: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` rows of [T, heads, D], heads and elements contiguous
    (rows may be spaced, as q, k and v are views of one projection): as is where they
    are (no op at all for a whole, unpadded pass: each costs microseconds here), else
    a copy."""
    if t.shape[0] != num_tokens:
        t = t[:num_tokens]
    _, step, one = t.stride()
    if one != 1 or step != t.shape[2]:
        return t.contiguous()
    return t


_CODES = {getattr(torch, name): code for name, code in KERNEL_DTYPES.items()}


def _check_tensors(query: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor) -> int:
    """What the kernel assumes of a layer's tensors, refused by name (it reads raw
    pointers); the kernel's code for their dtype."""
    if query.device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on the CPU, got {query.device}")
    code = _CODES.get(query.dtype)
    if code is None or key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(f"the cpu attention backend takes {' or '.join(KERNEL_DTYPES)} "
                         f"queries and caches of the same dtype, got {query.dtype}, "
                         f"{key_cache.dtype}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the cpu attention backend needs contiguous KV caches")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of KV heads "
                         f"({key_cache.shape[2]})")
    return code


def _check_metadata(meta: AttentionMetadata) -> None:
    """The metadata's shapes and layout, once per pass (the kernel checks the values)."""
    if (meta.block_table.dim() != 2 or meta.block_table.shape[0] < meta.num_reqs
            or meta.query_start_loc.numel() < meta.num_reqs + 1
            or meta.seq_lens.numel() < meta.num_reqs):
        raise ValueError(f"attention metadata holds fewer than num_reqs={meta.num_reqs} "
                         "requests (query_start_loc, seq_lens or block_table rows)")
    for name, t in (("query_start_loc", meta.query_start_loc), ("seq_lens", meta.seq_lens),
                    ("block_table", meta.block_table)):
        if t.dtype != torch.int32 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"the cpu attention backend needs {name} as a CPU int32 "
                             f"tensor with unit stride, got {t.dtype} on {t.device}")
    tree = meta.tree_prefix
    if tree is not None and (tree.dtype != torch.int32 or tree.device.type != "cpu"
                             or tree.stride(-1) != 1 or tree.numel() < meta.num_actual_tokens):
        raise ValueError("the cpu attention backend needs tree_prefix as a CPU int32 tensor "
                         "with unit stride and a value per token")
    slots = meta.slot_mapping
    if (slots.dtype != torch.int64 or slots.device.type != "cpu" or slots.stride(-1) != 1
            or slots.numel() < meta.num_actual_tokens):
        raise ValueError(f"the cpu attention backend needs slot_mapping as a CPU int64 "
                         f"tensor with unit stride and a slot per token "
                         f"({meta.num_actual_tokens}), got {slots.dtype} on {slots.device}, "
                         f"{slots.numel()} slots")
