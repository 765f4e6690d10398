"""Which linear kernel a model runs with here: the fastest candidate that passes the
row-invariance probe (runner/models/linear.py), for the dtype and quantization asked."""

from __future__ import annotations

import torch

from runner.models import linear_blocks
from runner.models.linear import (
    KernelChoice,
    LinearKernel,
    OneDNNLinear,
    RowCapped,
    TorchLinear,
    is_row_invariant,
)
from runner.models.linear_int8 import Int8DynamicLinear, fbgemm_available

QUANTIZATIONS = ("int8",)
# Row caps tried for oneDNN where its whole calls are not row-invariant, widest first:
# an Intel CPU with AMX changes path past 32 rows in bfloat16 (runner/models/linear.py
# `RowCapped`); a narrower cap is a guess at other machines, each costing only a probe.
ONEDNN_ROW_CAPS = (32, 16, 8)


def _candidates(dtype: torch.dtype, device: torch.device,
                quantization: str | None = None) -> list[LinearKernel]:
    if quantization == "int8":
        if device.type != "cpu" or not fbgemm_available():
            raise ValueError("quantization='int8' needs a CPU with torch's fbgemm engine, "
                             f"got device {device}")
        return [Int8DynamicLinear()]
    kernels: list[LinearKernel] = []
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        kernels.append(OneDNNLinear())
        kernels.extend(RowCapped(OneDNNLinear(), cap) for cap in ONEDNN_ROW_CAPS)
    kernels.append(TorchLinear())
    if dtype == torch.float32 and device.type == "cpu" and linear_blocks.available():
        # a weight dequantized from GGUF blocks runs from them, any other on the kernel
        # behind (runner/models/linear_blocks.py)
        kernels = [linear_blocks.BlockLinear(kernel) for kernel in kernels] + kernels
    return kernels


def select_linear_kernel(dtype: torch.dtype, device: torch.device | str,
                         in_features: int | tuple[int, ...],
                         quantization: str | None = None) -> KernelChoice:
    """The first candidate (fastest first) that is row-invariant here at every input
    width the model has (`in_features`: the hidden size, and the MLP's intermediate
    size, which its down projection reduces over); the last one, marked not
    row-invariant, when none is (plain `F.linear`, or the only kernel a quantization
    has)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, "
                         f"got {quantization!r}")
    device = torch.device(device)
    candidates = _candidates(dtype, device, quantization)
    for kernel in candidates:
        if _invariant(kernel, dtype, device, in_features):
            return KernelChoice(kernel, True)
    return KernelChoice(candidates[-1], False)


def _invariant(kernel: LinearKernel, dtype: torch.dtype, device: torch.device,
               in_features: int | tuple[int, ...]) -> bool:
    """`is_row_invariant` at every input width given."""
    widths = (in_features,) if isinstance(in_features, int) else in_features
    return all(is_row_invariant(kernel, dtype, width, device=str(device)) for width in widths)


def fastest_linear_kernel(dtype: torch.dtype, device: torch.device | str,
                          in_features: int | tuple[int, ...]) -> KernelChoice:
    """The fastest candidate that runs here, row-invariant or not (its choice says
    which), for work that reads no row against the same row in a call of another
    width: the drafter's training data, made at a fixed batch (runner/models/linear.py
    `RowCapped`: on an AMX CPU the invariant kernel costs wide calls ~2x)."""
    device = torch.device(device)
    width = in_features if isinstance(in_features, int) else in_features[0]
    for kernel in _candidates(dtype, device):
        try:
            kernel.pack(torch.zeros(8, width, dtype=dtype, device=device), None)
        except (RuntimeError, NotImplementedError):
            continue  # the kernel does not run here at all
        return KernelChoice(kernel, _invariant(kernel, dtype, device, in_features))
    raise RuntimeError(f"no linear kernel runs {dtype} on {device}")
