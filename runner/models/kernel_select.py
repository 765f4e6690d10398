"""Which linear kernel a model runs with here: the fastest candidate that passes the
row-invariance probe (runner/models/linear.py), for the dtype and quantization asked."""

from __future__ import annotations

import torch

from runner.models.linear import (
    KernelChoice,
    LinearKernel,
    OneDNNLinear,
    TorchLinear,
    is_row_invariant,
)
from runner.models.linear_int8 import Int8DynamicLinear, fbgemm_available

QUANTIZATIONS = ("int8",)


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
    kernels.append(TorchLinear())
    return kernels


def select_linear_kernel(dtype: torch.dtype, device: torch.device | str,
                         in_features: int, quantization: str | None = None) -> KernelChoice:
    """The first candidate (fastest first) that is row-invariant here; the last one,
    marked not row-invariant, when none is (plain `F.linear`, or the only kernel a
    quantization has)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, "
                         f"got {quantization!r}")
    device = torch.device(device)
    candidates = _candidates(dtype, device, quantization)
    for kernel in candidates:
        if is_row_invariant(kernel, dtype, in_features, device=str(device)):
            return KernelChoice(kernel, True)
    return KernelChoice(candidates[-1], False)
