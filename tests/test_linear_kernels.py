"""Linear kernels: packed results equal the plain maths, rows are independent of what
shares the call, and a kernel that is not falls back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner.models import linear
from runner.models.linear import (
    LinearKernel,
    OneDNNLinear,
    PackedLinear,
    TorchLinear,
    is_row_invariant,
    select_linear_kernel,
)


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


class _RowCountLeaks(LinearKernel):
    """Broken on purpose: a row's result moves by one ulp with the number of rows."""

    name = "leaky"

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        inner = TorchLinear().pack(weight, bias)

        class Leaky(PackedLinear):
            out_features = inner.out_features

            def __call__(self, x: torch.Tensor) -> torch.Tensor:
                out = inner(x)
                return torch.nextafter(out, out + 1) if x.shape[0] % 2 else out

            def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
                return residual + self(x)

        return Leaky()


def test_the_probe_catches_a_kernel_whose_rows_depend_on_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert not is_row_invariant(_RowCountLeaks(), torch.float32, in_features=64)
    # select_linear_kernel skips it for the next invariant candidate...
    monkeypatch.setattr(linear, "_candidates",
                        lambda dtype, device: [_RowCountLeaks(), OneDNNLinear(), TorchLinear()])
    choice = select_linear_kernel(torch.float32, "cpu", 64)
    assert choice.kernel.name == "onednn" and choice.row_invariant
    # ...and says so when no candidate is.
    monkeypatch.setattr(linear, "_candidates", lambda dtype, device: [_RowCountLeaks()])
    choice = select_linear_kernel(torch.float32, "cpu", 64)
    assert choice.kernel.name == "leaky" and not choice.row_invariant
    assert "NOT row-invariant" in choice.description


def test_a_kernel_that_cannot_run_here_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refuses(LinearKernel):
        name = "refuses"

        def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
            raise RuntimeError("needs avx512")

    monkeypatch.setattr(linear, "_candidates",
                        lambda dtype, device: [Refuses(), OneDNNLinear(), TorchLinear()])
    assert select_linear_kernel(torch.float32, "cpu", 64).kernel.name == "onednn"
