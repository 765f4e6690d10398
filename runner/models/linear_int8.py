"""int8 weights (`quantization="int8"`, CPU): torch's fbgemm operator, made row-invariant
and accurate.

`quantized::linear_dynamic` multiplies int8 weights (quantized per output channel) by
activations it quantizes itself at every call, sums in int32 and returns float32. As
it stands it has two faults for this engine:

- it picks one activation scale per *call* from the whole input's min and max, so a
  row's result depends on the other rows in the pass, and greedy verification would
  not choose what plain decoding chooses;
- its activations have 7 bits (8 would overflow AVX2's int16 pair sums), too few for
  this model: per-row scaling alone agreed with float32's top-1 on 77 % of held-out
  positions.

What this module feeds it instead:

- two constant input columns (weights zero) pin the call's range to [-64, 63], so its
  activation scale is exactly 1 and its zero point exactly 64 in every call;
- each row is scaled by its own largest magnitude onto [-63, 63] and split in two
  rows: the rounded integers, and the rounding remainder (within +-1/2) scaled by 126.
  Both are integers the quantizer keeps exactly; the output is
  (W*high + W*low / 126) times the row's scale: ~14-bit activations, so the only
  error left is the weights' (top-1 96.1 % against float32, the same as int8 weights
  with exact activations).

Every float operation left is element-wise and the int32 sums are exact: a row's bits
do not depend on the call (`is_row_invariant` checks it at start, as for every kernel).
The price is two kernel rows per row: measured here (`benchmarks/cpu_forward.py`), a
1-row pass costs ~0.8x float32's, but 5 rows ~1.1x and 17 rows ~1.5x, so int8 pays
for plain decoding and not for verification.
"""

from __future__ import annotations

import warnings

import torch

from runner.models.linear import LinearKernel, PackedLinear

_INF = float("inf")
# Smaller than any real activation's magnitude, larger than 0: an all-zero row divides by
# this instead of by 0 and comes out 0.
_TINY = 1e-30
# Activations in 7 bits (fbgemm's own x86 default): AVX2's u8 x s8 pair products are
# summed in int16 and would saturate with 8-bit activations.
_REDUCE_RANGE = True
# The pinned range [-64, 63] makes the kernel's activation scale exactly 1 and its zero
# point exactly 64: integers in [-63, 63] pass through the kernel's quantizer unchanged.
_LOW, _HIGH = -64.0, 63.0
_PEAK = 63.0  # a row's largest magnitude lands here; the weights carry the 1/63 back
_ZERO = torch.zeros(())
_LOW_GAIN = 126.0  # the rounding remainder, in [-1/2, 1/2], scaled to [-63, 63]


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class _Scratch:
    """The call's input rows for every input width, with the two pinning columns set
    once; views per (rows, width) cached, since a pass calls every layer with its rows."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def views(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the call's input [2 * rows, width + 2], the high rows' and the low rows'
        first `width` columns to fill)."""
        found = self._views.get((rows, width))
        if found is not None:
            return found
        buffer = self._buffers.get(width)
        if buffer is None or buffer.shape[0] < 2 * rows:
            # Grows in powers of two: a handful of reallocations over an engine's life.
            capacity = max(64, 1 << (2 * rows - 1).bit_length())
            buffer = torch.zeros(capacity, width + 2)
            buffer[:, width], buffer[:, width + 1] = _LOW, _HIGH
            self._buffers[width] = buffer
            self._views = {k: v for k, v in self._views.items() if k[1] != width}
        views = (buffer[:2 * rows], buffer[:rows, :width], buffer[rows:2 * rows, :width])
        self._views[(rows, width)] = views
        return views


class _Int8Packed(PackedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 scratch: _Scratch) -> None:
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        padded = torch.cat([weight / _PEAK, weight.new_zeros(self.out_features, 2)], dim=1)
        scale = (padded.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        zero = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated, the op is not
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(padded, scale, zero, 0, torch.qint8)
            # The bias is added after the rows are scaled back, not inside the kernel.
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if bias is None else bias.detach().float().clone()
        self.scratch = scratch

    def _product(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W times x's rows scaled to a largest magnitude of 1 [T, out], each row's
        largest magnitude [T, 1])."""
        if x.dtype != torch.float32:
            raise TypeError(f"int8 linear layers take float32 activations, got {x.dtype}")
        rows = x.shape[0]
        full, high, low = self.scratch.views(rows, self.in_features)
        unit = torch.linalg.vector_norm(x, _INF, dim=1, keepdim=True).clamp_min_(_TINY)
        v = torch.addcdiv(_ZERO, x, unit, value=_PEAK)  # within [-63, 63]
        torch.round(v, out=high)
        torch.sub(v, high, out=low)
        low.mul_(_LOW_GAIN)
        product = torch.ops.quantized.linear_dynamic(full, self.packed, _REDUCE_RANGE)
        return torch.add(product[:rows], product[rows:], alpha=1 / _LOW_GAIN), unit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        product, unit = self._product(x)
        if self.bias is None:
            return product.mul_(unit)
        return torch.addcmul(self.bias, product, unit)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return residual.clone()
        product, unit = self._product(x)
        if self.bias is not None:
            residual = residual + self.bias
        return torch.addcmul(residual, product, unit)


class Int8DynamicLinear(LinearKernel):
    """fbgemm int8 weights, per-row dynamic int8 activations (CPU, float32 in and out)."""

    name = "fbgemm-int8"
    quantization = "int8"

    def __init__(self) -> None:
        self._scratch = _Scratch()  # one per model: layers run one after another

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        return _Int8Packed(weight, bias, self._scratch)
