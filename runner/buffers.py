"""Persistent step buffers, allocated once and sized by B and max_num_seqs only.

Each buffer has a host copy (a numpy view over a torch tensor, pinned when the device
is CUDA) that input preparation fills with vectorised numpy, and a device copy that
receives the used prefix once per step. On CPU the two are the same tensor.
"""

from __future__ import annotations

import numpy as np
import torch


class HostDeviceBuffer:
    """One persistent buffer: `.np` to fill on the host, `.copy_to_device(n)` to ship."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np: np.ndarray = self.cpu.numpy()
        self.gpu = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.cpu

    @property
    def nbytes(self) -> int:
        host = self.cpu.numel() * self.cpu.element_size()
        return host if self.gpu is self.cpu else 2 * host

    def copy_to_device(self, n: int) -> torch.Tensor:
        """Ship the first n rows; return the device view of them."""
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]


class StepBuffers:
    """Everything one forward pass reads besides the weights and the KV cache."""

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int,
                 max_blocks_per_req: int, device: torch.device) -> None:
        rows, seqs = max_num_batched_tokens, max_num_seqs

        def buf(*shape: int, dtype: torch.dtype = torch.int32) -> HostDeviceBuffer:
            return HostDeviceBuffer(shape, dtype, device)

        self.input_ids = buf(rows, dtype=torch.int64)  # [B]
        self.positions = buf(rows, dtype=torch.int64)  # [B]
        self.slot_mapping = buf(rows, dtype=torch.int64)  # [B]
        # Verification reads 1 + s logits per request (speculative decoding), so the
        # logits indices are bounded by B rather than by max_num_seqs.
        self.logits_indices = buf(rows, dtype=torch.int64)  # [B]
        # Each row's tree prefix (a drafted tree's leaves; -1 else): runner/draft_tree.py.
        self.tree_prefix = buf(rows)  # [B]
        self.query_start_loc = buf(seqs + 1)  # [max_num_seqs + 1]
        self.seq_lens = buf(seqs)  # [max_num_seqs]
        self.block_table = buf(seqs, max_blocks_per_req)  # [max_num_seqs, max_blocks]

    def all(self) -> list[HostDeviceBuffer]:
        return [value for value in vars(self).values() if isinstance(value, HostDeviceBuffer)]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.all())
