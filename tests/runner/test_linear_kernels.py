"""Linear kernels: packed results equal the plain maths, rows are independent of what
shares the call, and a kernel that is not falls back."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from runner.models import kernel_select, linear_blocks, linear_int8
from runner.models.kernel_select import select_linear_kernel
from runner.models.linear import (
    LinearKernel,
    OneDNNLinear,
    PackedLinear,
    RowCapped,
    TorchLinear,
    is_row_invariant,
)
from runner.models.linear_blocks import BlockLinear
from runner.models.linear_int8 import Int8DynamicLinear
from tests.helpers import kernel_that_packs


def _data(rows: int = 40, dtype: torch.dtype = torch.float32
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 64, generator=gen) * 0.1
    bias = torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    residual = torch.randn(rows, 96, generator=gen)
    return weight.to(dtype), bias.to(dtype), x.to(dtype), residual.to(dtype)


@pytest.mark.parametrize("kernel", [TorchLinear(), OneDNNLinear()], ids=lambda k: k.name)
def test_packed_kernels_compute_the_linear(kernel: LinearKernel) -> None:
    weight, bias, x, residual = _data()
    packed = kernel.pack(weight, bias)
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.add(x, residual), residual + expected,
                               rtol=1e-5, atol=1e-5)
    assert packed.out_features == 96


def test_onednn_packed_rows_do_not_depend_on_the_call() -> None:
    """The kernel the CPU runner uses in float32: every row bitwise the same alone, in
    the few rows of a verification pass, or in a wide prefill."""
    assert torch.backends.mkldnn.is_available(), "the pinned CPU torch build has oneDNN"
    assert is_row_invariant(OneDNNLinear(), torch.float32, in_features=576)
    weight, _, x, residual = _data(rows=200)
    packed = OneDNNLinear().pack(weight, None)
    wide, wide_add = packed(x), packed.add(x, residual)
    for rows in (1, 2, 4, 5, 17, 64):
        assert torch.equal(packed(x[:rows]), wide[:rows])
        assert torch.equal(packed.add(x[:rows], residual[:rows]), wide_add[:rows])


class _Perturbed(LinearKernel):
    """Broken on purpose: float32 oneDNN (row-invariant here) whose output
    `perturb(out)` moves by one ulp in some rows, depending on the call."""

    def __init__(self, name: str, perturb: Callable[[torch.Tensor], None]) -> None:
        self.name, self.perturb = name, perturb

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        inner, perturb = OneDNNLinear().pack(weight, bias), self.perturb

        class Leaky(PackedLinear):
            out_features = inner.out_features

            def __call__(self, x: torch.Tensor) -> torch.Tensor:
                out = inner(x)
                perturb(out)
                return out

            def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
                return residual + self(x)

        return Leaky()


def _odd_calls(out: torch.Tensor) -> None:
    """A call with an odd number of rows moves every row."""
    if out.shape[0] % 2:
        out.copy_(torch.nextafter(out, out + 1))


def _row_four(out: torch.Tensor) -> None:
    """Row 4 of a call of more than 4 rows moves (what oneDNN did here to the MLP's
    1536-wide reduction): every prefix of a wide call agrees with the wide call, so
    only a row alone against its place in the call shows it."""
    if out.shape[0] > 4:
        out[4] = torch.nextafter(out[4], out[4] + 1)


def _RowCountLeaks() -> LinearKernel:
    return _Perturbed("leaky", _odd_calls)


def test_the_probe_catches_a_kernel_whose_rows_depend_on_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert not is_row_invariant(_RowCountLeaks(), torch.float32, in_features=64)
    # select_linear_kernel skips it for the next invariant candidate...
    monkeypatch.setattr(kernel_select, "_candidates",
                        lambda *_: [_RowCountLeaks(), OneDNNLinear(), TorchLinear()])
    choice = select_linear_kernel(torch.float32, "cpu", 64)
    assert choice.kernel.name == "onednn" and choice.row_invariant
    # ...and says so when no candidate is.
    monkeypatch.setattr(kernel_select, "_candidates", lambda *_: [_RowCountLeaks()])
    choice = select_linear_kernel(torch.float32, "cpu", 64)
    assert choice.kernel.name == "leaky" and not choice.row_invariant
    assert "NOT row-invariant" in choice.description


def test_the_probe_catches_a_row_whose_bits_depend_on_its_index() -> None:
    assert not is_row_invariant(_Perturbed("index-leaks", _row_four), torch.float32,
                                in_features=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_chosen_here_is_onednn_and_row_invariant_at_every_width(
        dtype: torch.dtype) -> None:
    """576 (hidden), 1536 (the MLP's down projection) and 1728 (an EAGLE-3 head's fc):
    the wide ones run as slices of at most MAX_REDUCTION inputs. oneDNN whole on an
    AVX-512 Zen 5; in bfloat16 on an Intel CPU with AMX, calls capped at 32 rows
    (`RowCapped`): either way not the `F.linear` fallback where oneDNN runs the dtype.
    Where it does not (bfloat16 on an AVX2 EPYC), `F.linear`, still row-invariant."""
    choice = select_linear_kernel(dtype, "cpu", (576, 1536))
    expected = "onednn" if isinstance(kernel_that_packs(dtype), OneDNNLinear) else "torch"
    kernel = choice.kernel
    if dtype == torch.float32 and linear_blocks.available():
        # float32 weights from GGUF blocks run from them, any other weight on oneDNN
        assert isinstance(kernel, BlockLinear), choice.description
        kernel = kernel.inner
    assert choice.row_invariant and kernel.name.startswith(expected), choice.description
    for width in (576, 1536, 1728):
        assert is_row_invariant(choice.kernel, dtype, in_features=width), width


def _past_four(out: torch.Tensor) -> None:
    """A call of more than 4 rows moves every row (a kernel that changes path past 4
    rows, as oneDNN does past 32 in bfloat16 on an AMX CPU)."""
    if out.shape[0] > 4:
        out.copy_(torch.nextafter(out, out + 1))


@pytest.mark.parametrize("cap", [4, 3, 1])
def test_a_row_cap_at_or_below_a_kernels_path_change_makes_it_row_invariant(
        monkeypatch: pytest.MonkeyPatch, cap: int) -> None:
    leaky = _Perturbed("wide-path", _past_four)
    assert not is_row_invariant(leaky, torch.float32, in_features=64)
    capped = RowCapped(leaky, cap)
    assert is_row_invariant(capped, torch.float32, in_features=64)
    # Wide calls are the same maths, in slices: rows and the residual stay paired.
    weight, bias, x, residual = _data(rows=11)
    packed = capped.pack(weight, bias)
    torch.testing.assert_close(packed(x), F.linear(x, weight, bias))
    torch.testing.assert_close(packed.add(x, residual), residual + F.linear(x, weight, bias))
    assert packed.out_features == 96
    # select_linear_kernel takes the capped kernel before the fallback.
    monkeypatch.setattr(kernel_select, "_candidates",
                        lambda *_: [leaky, RowCapped(leaky, cap), TorchLinear()])
    choice = select_linear_kernel(torch.float32, "cpu", 64)
    assert choice.row_invariant and choice.kernel.name == f"wide-path, at most {cap} rows a call"


def test_a_row_cap_past_the_path_change_is_refused() -> None:
    assert not is_row_invariant(RowCapped(_Perturbed("wide-path", _past_four), 5),
                                torch.float32, in_features=64)


def test_a_kernel_that_cannot_run_here_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refuses(LinearKernel):
        name = "refuses"

        def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
            raise RuntimeError("needs avx512")

    monkeypatch.setattr(kernel_select, "_candidates",
                        lambda *_: [Refuses(), OneDNNLinear(), TorchLinear()])
    assert select_linear_kernel(torch.float32, "cpu", 64).kernel.name == "onednn"


# ---- int8 -----------------------------------------------------------------------------

def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def _weight_only_int8(weight: torch.Tensor) -> torch.Tensor:
    scale = weight.abs().amax(1, keepdim=True) / 127
    return (weight / scale).round() * scale


def test_int8_kernel_error_is_the_weights_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an outlier channel in the activations, the kernel is as accurate as int8
    weights times exact activations; without the remainder row it is not."""
    weight, bias, x, residual = _data()
    x[:, 5] *= 30
    expected = F.linear(x, weight, bias)
    floor = _relative_error(F.linear(x, _weight_only_int8(weight), bias), expected)
    packed = Int8DynamicLinear().pack(weight, bias)
    assert _relative_error(packed(x), expected) < 1.05 * floor
    assert _relative_error(packed.add(x, residual), residual + expected) < 1.05 * floor
    assert packed.out_features == 96
    monkeypatch.setattr(linear_int8, "_LOW_GAIN", 1e-30)  # broken: 7-bit activations
    assert _relative_error(Int8DynamicLinear().pack(weight, bias)(x), expected) > 3 * floor


def test_int8_kernel_rows_do_not_depend_on_the_call() -> None:
    """Per-row scales and the pinned [-1, 1] range make the per-call activation scale a
    constant: a row's bits are the same alone and in any pass, for every width the model
    has (576: hidden, 1536: MLP, 1728: an EAGLE-3 head's fc)."""
    for width in (576, 1536, 1728):
        assert is_row_invariant(Int8DynamicLinear(), torch.float32, in_features=width)
    weight, bias, x, residual = _data(rows=200)
    x[3] *= 1000  # one loud row must not move the others
    packed = Int8DynamicLinear().pack(weight, bias)
    wide, wide_add = packed(x), packed.add(x, residual)
    for rows in (1, 2, 5, 17, 64):
        assert torch.equal(packed(x[:rows]), wide[:rows])
        assert torch.equal(packed.add(x[:rows], residual[:rows]), wide_add[:rows])


class _PerCallScale(LinearKernel):
    """Broken on purpose: fbgemm's operator as it is, one activation scale per call."""

    name = "per-call-scale"

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        inner = Int8DynamicLinear().pack(weight, bias)
        assert hasattr(inner, "packed")

        class PerCall(PackedLinear):
            out_features = inner.out_features

            def __call__(self, x: torch.Tensor) -> torch.Tensor:
                padded = torch.cat([x, x.new_zeros(x.shape[0], 2)], dim=1)
                return torch.ops.quantized.linear_dynamic(padded, inner.packed, True)

            def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
                return residual + self(x)

        return PerCall()


def test_the_probe_catches_int8_with_one_activation_scale_per_call() -> None:
    assert not is_row_invariant(_PerCallScale(), torch.float32, in_features=576)


def test_int8_kernel_edge_rows() -> None:
    weight, bias, x, residual = _data(rows=4)
    packed = Int8DynamicLinear().pack(weight, bias)
    x[1] = 0.0  # an all-zero row gives the bias, not NaN
    assert torch.equal(packed(x)[1], bias)
    x[2] = 1e30  # a huge row stays finite
    assert torch.isfinite(packed(x)).all()
    assert packed(x[:0]).shape == (0, 96)
    assert torch.equal(packed.add(x[:0], residual[:0]), residual[:0])
    with pytest.raises(TypeError, match="float32 activations"):
        packed(x.bfloat16())


def test_select_int8() -> None:
    choice = select_linear_kernel(torch.float32, "cpu", 576, quantization="int8")
    assert choice.kernel.name == "fbgemm-int8" and choice.row_invariant
    assert choice.kernel.quantization == "int8"
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        select_linear_kernel(torch.float32, "cpu", 576, quantization="int4")
    with pytest.raises(ValueError, match="needs a CPU"):
        select_linear_kernel(torch.float32, "cuda", 576, quantization="int8")


def test_the_fastest_kernel_is_the_first_that_runs_invariant_or_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """For the drafter's training data: the first candidate that runs, and its choice
    says honestly whether its rows are invariant."""
    class Refuses(LinearKernel):
        name = "refuses"

        def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
            raise RuntimeError("needs avx512")

    leaky = _Perturbed("wide-path", _past_four)
    monkeypatch.setattr(kernel_select, "_candidates",
                        lambda *_: [Refuses(), leaky, RowCapped(leaky, 4), TorchLinear()])
    choice = kernel_select.fastest_linear_kernel(torch.float32, "cpu", (64, 128))
    assert choice.kernel is leaky and not choice.row_invariant
    monkeypatch.setattr(kernel_select, "_candidates", lambda *_: [RowCapped(leaky, 4)])
    assert kernel_select.fastest_linear_kernel(torch.float32, "cpu", 64).row_invariant
