"""Linear layers prepared once for the kernel that runs them at inference.

A decode or verification step multiplies a few rows by every weight of the model, so
the kernel's cost at 1-17 rows is the step's cost. Measured on this project's 2-core
AVX2 machine (float32, the 30 layers + LM head of SmolLM2-135M, ms per forward at
1 / 2 / 5 / 17 / 64 rows): `F.linear` 52 / 85 / 130 / 212 / 401, oneDNN with the
weight packed once 42 / 44 / 54 / 104 / 275 (`benchmarks/cpu_forward.py`).

A kernel must also give a row the same bits whatever else shares the call: greedy
speculative decoding verifies k + 1 rows in a pass where plain decoding has one, and
the two must choose the same tokens. `F.linear` in float32 does not (one to a few rows
take a matrix-vector path that sums in another order); the packed oneDNN kernel does.
`select_linear_kernel` (runner/models/kernel_select.py) checks that on this machine at
start and keeps the first candidate that passes, so a machine whose libraries behave
otherwise falls back instead of silently diverging.

A float32 weight dequantized from GGUF blocks (the default model's) runs from the blocks
instead (runner/models/linear_blocks.py): a quarter of the bytes or less, the same
weights bit for bit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class PackedLinear(ABC):
    """One layer's weight (and bias) in the kernel's layout."""

    out_features: int
    # Rows a call takes at most (a wider call runs as several, each streaming the
    # weight again); None: any number.
    max_rows: int | None = None

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""

    @abstractmethod
    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x), fused where the kernel can."""


class LinearKernel(ABC):
    name: str = "?"
    quantization: str | None = None  # None: weights in the model's dtype

    @abstractmethod
    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        """weight [out, in]. Pack again after changing a weight: a packed copy does
        not follow it."""

    def probe_weights(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Weights the row-invariance probe packs in place of a random `weight`: one
        per path `pack` can choose (a kernel for weights of some form adds one of that
        form)."""
        return (weight,)


class _TorchPacked(PackedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + F.linear(x, self.weight, self.bias)


class TorchLinear(LinearKernel):
    """Plain `F.linear` (any device, any dtype): the fallback."""

    name = "torch"

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        return _TorchPacked(weight, bias)


# oneDNN splits a longer reduction at points that move with the number of rows (here,
# an AVX-512 Zen 5: 1536 inputs, the MLP's down projection, in bf16 and float32 alike;
# 576 and 768 never): a weight wider than this runs as equal slices of at most this
# many inputs, each slice's product added to the last by the kernel's add post-op, in
# a fixed order, so a row's sum no longer depends on what shares the call.
MAX_REDUCTION = 768


# oneDNN runs a call of exactly this many rows slower than one of a row more: in the
# default model's forward on this project's Zen 5, bfloat16, 1 / 2 / 3 / 4 rows 20.1 /
# 22.7 / 20.7 / 20.6 ms (one thread: 27.1 / 30.9 / 26.3 / 26.1), every layer's calls
# alike. That is every step of fixed K = 1 at one request, and every plain decode step
# at two. Such a call runs with a copy of its first row appended and the copy's row
# dropped: a row's bits do not depend on what shares the call (checked at start,
# runner/models/kernel_select.py), so the two rows come out as they would alone.
SLOW_ROWS = 2


def _padded(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x, x[:1])) if x.shape[0] == SLOW_ROWS else x


class _OneDNNPacked(PackedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 max_reduction: int | None) -> None:
        weight = weight.detach().contiguous()
        num_slices = 1 if max_reduction is None else -(-weight.shape[1] // max_reduction)
        width = -(-weight.shape[1] // num_slices)
        self.bounds = [(start, min(start + width, weight.shape[1]))
                       for start in range(0, weight.shape[1], width)]
        self.packed = [torch.ops.mkldnn._reorder_linear_weight(
            weight[:, lo:hi].contiguous(), None) for lo, hi in self.bounds]
        self.bias = None if bias is None else bias.detach().clone()
        self.out_features = weight.shape[0]

    def _slice(self, x: torch.Tensor, i: int) -> torch.Tensor:
        lo, hi = self.bounds[i]
        return x if len(self.bounds) == 1 else x[..., lo:hi].contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, x = x.shape[0], _padded(x)
        out = torch.ops.mkldnn._linear_pointwise(self._slice(x, 0), self.packed[0],
                                                 self.bias, "none", [], "")
        return self._accumulate(x, out, 1)[:rows]

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        rows, x, residual = x.shape[0], _padded(x), _padded(residual)
        out = torch.ops.mkldnn._linear_pointwise.binary(self._slice(x, 0), residual,
                                                        self.packed[0], self.bias, "add")
        return self._accumulate(x, out, 1)[:rows]

    def _accumulate(self, x: torch.Tensor, out: torch.Tensor, first: int) -> torch.Tensor:
        for i in range(first, len(self.bounds)):
            out = torch.ops.mkldnn._linear_pointwise.binary(self._slice(x, i), out,
                                                            self.packed[i], None, "add")
        return out


class OneDNNLinear(LinearKernel):
    """oneDNN on CPU with the weight reordered once (what torch.compile's CPU backend
    uses after freezing); the residual add runs as the kernel's post-op."""

    name = "onednn"

    def __init__(self, max_reduction: int | None = MAX_REDUCTION) -> None:
        # None: one call whatever the reduction's width, for a caller that needs no row
        # invariance (a drafter: runner/models/linear_draft.py)
        self.max_reduction = max_reduction
        if max_reduction is None:
            self.name = "onednn, unsliced"

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        return _OneDNNPacked(weight, bias, self.max_reduction)


class _RowCappedPacked(PackedLinear):
    max_rows: int

    def __init__(self, inner: PackedLinear, max_rows: int) -> None:
        self.inner, self.max_rows = inner, max_rows
        self.out_features = inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            return self.inner(x)
        return torch.cat([self.inner(part) for part in x.split(self.max_rows)])

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            return self.inner.add(x, residual)
        return torch.cat([self.inner.add(part, res) for part, res in
                          zip(x.split(self.max_rows), residual.split(self.max_rows),
                              strict=True)])


class RowCapped(LinearKernel):
    """`inner` with no call of more than `max_rows` rows: a wider one runs as slices of
    at most that many, one after the other.

    For a kernel that sums a row in one order up to some number of rows and in another
    past it. oneDNN in bfloat16 on an Intel CPU with AMX (this project's machine on
    2026-12-06) runs calls of up to 32 rows on one path and wider ones on AMX tiles:
    a row of a 5-row verification pass then had the bits it has alone, the same row
    in a 64-row call other bits, so greedy speculation was not lossless beside other
    requests, and the engine fell back to `F.linear` (itself not row-invariant, and
    1.5x slower at 1-17 rows there). Capped at 32, every call takes the first path. The
    price is paid by wide calls only (there: the default model's linear layers 18 ms
    for 1-5 rows, 43 ms for 64 against 25 uncapped, 279 for 512 against 111; `F.linear`
    27 / 33 / 98)."""

    def __init__(self, inner: LinearKernel, max_rows: int) -> None:
        self.inner, self.max_rows = inner, max_rows
        self.name = f"{inner.name}, at most {max_rows} rows a call"
        self.quantization = inner.quantization

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        return _RowCappedPacked(self.inner.pack(weight, bias), self.max_rows)


@dataclass(frozen=True)
class KernelChoice:
    """The kernel a model runs with, and whether rows are independent under it."""

    kernel: LinearKernel
    row_invariant: bool

    @property
    def description(self) -> str:
        state = "row-invariant" if self.row_invariant else "NOT row-invariant"
        return f"{self.kernel.name} ({state})"


# Row counts checked against a wide call: one row (matrix-vector paths), the small
# counts verification uses, and counts past a register tile.
_PROBE_ROWS = (1, 2, 3, 5, 7, 9, 17, 33)


def is_row_invariant(kernel: LinearKernel, dtype: torch.dtype, in_features: int,
                     out_features: int = 256, device: str = "cpu") -> bool:
    """Whether each row of `kernel`'s output is bitwise the same whatever else shares
    the call: for every row count in `_PROBE_ROWS`, each row alone against the same row
    inside the call, with and without the residual post-op, on random data of these
    shapes, for each weight `kernel.probe_weights` gives. (A row alone against its
    place in a wider call, not only prefixes: some kernels give a row other bits at
    another index of the same call.)"""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    x = torch.randn(64, in_features, generator=gen).to(dtype).to(device)
    residual = torch.randn(64, out_features, generator=gen).to(dtype).to(device)
    try:
        return all(_rows_alone(kernel.pack(probe.to(device), None), x, residual)
                   for probe in kernel.probe_weights(weight))
    except (RuntimeError, NotImplementedError):
        return False  # the kernel does not run here at all


def _rows_alone(packed: PackedLinear, x: torch.Tensor, residual: torch.Tensor) -> bool:
    alone = torch.cat([packed(x[i:i + 1]) for i in range(64)])
    alone_add = torch.cat([packed.add(x[i:i + 1], residual[i:i + 1]) for i in range(64)])
    return all(torch.equal(packed(x[:m]), alone[:m])
               and torch.equal(packed.add(x[:m], residual[:m]), alone_add[:m])
               for m in (*_PROBE_ROWS, 64))
