"""The GGUF-block kernel (runner/models/linear_blocks.py, gemv_blocks.c): it finds the
blocks a float32 weight was dequantized from, rebuilds every weight bit for bit, sums
like a float32 kernel, gives a row the same bits whatever shares the call, and leaves
every other weight to the kernel behind it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.models import linear_blocks
from runner.models.linear import OneDNNLinear, PackedLinear, TorchLinear, is_row_invariant
from runner.models.linear_blocks import BlockLinear, find_blocks, quantized

pytestmark = pytest.mark.skipif(not linear_blocks.available(),
                                reason=f"no GGUF-block kernel here: {linear_blocks.load()[1]}")


def _weight(n: int, k: int, bits: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return quantized(torch.randn(n, k, generator=gen) * 0.05, bits)


def _bits(t: torch.Tensor) -> np.ndarray:
    return (t.numpy() + 0).view(np.int32)  # + 0: a zero's sign is +


def _dequantized(blocks: linear_blocks.Blocks) -> np.ndarray:
    """The conversion's formula (gguf's dequantize) on the codes and scales found."""
    scale = np.repeat(blocks.scales, linear_blocks.GROUP, axis=1)
    out = scale * blocks.codes.astype(np.float32)
    if blocks.bits == 4:
        out = out + np.repeat(blocks.minimums, linear_blocks.GROUP, axis=1)
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_weight_is_found_in_its_format_and_rebuilt_bit_for_bit(bits: int) -> None:
    weight = _weight(100, 576, bits)
    blocks = find_blocks(weight)
    assert blocks is not None and blocks.bits == bits
    assert np.array_equal((_dequantized(blocks) + 0).view(np.int32), _bits(weight))
    packed = BlockLinear(OneDNNLinear()).pack(weight, None)
    assert type(packed).__name__ == "_BlocksPacked"
    # one-hot rows through the kernel: the weights it multiplies by, exactly
    assert np.array_equal(_bits(packed.weight()), _bits(weight))


def test_a_weight_off_its_blocks_by_one_ulp_is_not_found_and_runs_on_the_inner_kernel() -> None:
    weight = _weight(64, 576, 4)
    assert find_blocks(weight) is not None
    broken = weight.clone()
    broken[17, 300] = torch.nextafter(broken[17, 300], torch.tensor(1.0))
    assert find_blocks(broken) is None
    assert find_blocks(torch.randn(64, 576)) is None  # a trained float32 weight
    assert find_blocks(weight[:, :96].contiguous()) is None  # inputs not a multiple of 64
    inner = OneDNNLinear()
    assert type(BlockLinear(inner).pack(broken, None)) is type(inner.pack(broken, None))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 64])
def test_outputs_match_float64_with_bias_residual_and_strided_rows(bits: int, rows: int) -> None:
    """N = 150: neither a multiple of 16 nor of the 96 outputs a one-row call takes at
    once; K = 640: ten chunks."""
    weight, gen = _weight(150, 640, bits, seed=rows), torch.Generator().manual_seed(rows)
    bias = torch.randn(150, generator=gen)
    wide = torch.randn(rows, 700, generator=gen)
    x = wide[:, 30:670]  # rows 700 floats apart
    residual = torch.randn(rows, 150, generator=gen)
    packed = BlockLinear(TorchLinear()).pack(weight, bias)
    reference = x.double() @ weight.double().T + bias.double()
    assert torch.allclose(packed(x).double(), reference, atol=1e-4)
    assert torch.allclose(packed.add(x, residual).double(), reference + residual.double(),
                          atol=1e-4)
    # a residual of another shape goes to the inner kernel, which refuses it, instead of
    # being read past its end
    with pytest.raises(RuntimeError):
        packed.add(x, residual[:, :100])


def test_rows_have_the_bits_they_have_alone_for_block_weights_and_any_other() -> None:
    kernel = BlockLinear(OneDNNLinear())
    assert [w.shape for w in kernel.probe_weights(torch.randn(8, 576))] == [(8, 576)] * 3
    for width in (576, 1536):
        assert is_row_invariant(kernel, torch.float32, in_features=width)


def test_the_probe_packs_block_weights_so_a_leak_in_the_kernel_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose block path gives a wide call's rows other bits: the probe's
    random weight never reaches that path (it is not made of blocks), its block
    weights do."""
    packed_cls = type(BlockLinear(OneDNNLinear()).pack(_weight(16, 64, 4), None))
    run = packed_cls._run

    def leaky(self: PackedLinear, x: torch.Tensor, residual: torch.Tensor | None,
              bias: bool = True) -> torch.Tensor:
        out = run(self, x, residual, bias)
        return out * (1 + 2 ** -20) if x.shape[0] > 4 else out

    monkeypatch.setattr(packed_cls, "_run", leaky)
    kernel = BlockLinear(OneDNNLinear())
    assert not is_row_invariant(kernel, torch.float32, in_features=576)
    assert is_row_invariant(OneDNNLinear(), torch.float32, in_features=576)


@pytest.mark.model
def test_the_default_model_runs_every_linear_layer_from_its_blocks() -> None:
    """SmolLM2-135M ships as Q4_1 with a Q8_0 embedding (= its LM head): packed for
    float32, each linear layer runs from the blocks and the LM head from 8-bit ones."""
    from runner.model_loader import load_model, pack_for_inference
    from runner.model_prep import resolve_model

    model = pack_for_inference(load_model(resolve_model(None)), "cpu")
    assert model.kernel_choice is not None and model.kernel_choice.row_invariant
    layer = model.model.layers[0]
    packed = {"qkv": layer.self_attn._qkv, "o": layer.self_attn._o,
              "gate_up": layer.mlp._gate_up, "down": layer.mlp._down,
              "lm_head": model._lm_head}
    assert {name: getattr(p, "bits", None) for name, p in packed.items()} == {
        "qkv": 4, "o": 4, "gate_up": 4, "down": 4, "lm_head": 8}
    x = torch.randn(3, 1536)
    down = layer.mlp.down_proj.weight
    assert torch.allclose(packed["down"](x), x @ down.T, atol=1e-4)
