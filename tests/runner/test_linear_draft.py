"""A drafter's linear kernels (runner/models/linear_draft.py): the bfloat16 gemv and the
float32 one (its weight held in bfloat16) compute the linear for calls of a few rows,
wider calls take the fallback, and the choice follows the target's kernel and dtype."""

from __future__ import annotations

import pytest
import torch

from runner.models import linear_blocks, linear_draft
from runner.models.linear import (
    OneDNNLinear,
    RowCapped,
    TorchLinear,
    _OneDNNPacked,
    is_row_invariant,
)
from runner.models.linear_blocks import BlockLinear, quantized
from runner.models.linear_draft import MAX_ROWS, DraftGemv, draft_kernel
from runner.models.linear_int8 import Int8DynamicLinear


def _needs(dtype: torch.dtype) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        linear_draft.load(dtype)[0] is None,
        reason=f"the drafter's {dtype} gemv kernel does not run here: "
               f"{linear_draft.load(dtype)[1]}")


needs_gemv = _needs(torch.bfloat16)
needs_f32_gemv = _needs(torch.float32)
# Each kernel with the activations' dtype it takes, skipped where it does not run.
KERNELS = [pytest.param(torch.bfloat16, marks=needs_gemv, id="bf16"),
           pytest.param(torch.float32, marks=needs_f32_gemv, id="f32")]


def _data(out_features: int, in_features: int, rows: int, seed: int = 0,
          dtype: torch.dtype = torch.bfloat16
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    residual = torch.randn(rows, out_features, generator=gen).to(dtype)
    return weight, bias, x, residual


def _bound(dtype: torch.dtype) -> float:
    """The error a kernel may make: bfloat16's rounding of its output (bf16), else none
    beyond float32's sums of the weight as bfloat16 holds it (f32)."""
    return 1e-2 if dtype == torch.bfloat16 else 1e-5


def _max_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest error as a fraction of the largest expected value."""
    return ((out.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("dtype", KERNELS)
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(576, 576), (8192, 576), (100, 64), (33, 1728), (20, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_computes_the_linear(dtype: torch.dtype, out_features: int, in_features: int,
                                  with_bias: bool) -> None:
    """Every row count to MAX_ROWS and past it (the bf16 kernel's fallback; the f32
    kernel takes them all), sizes that fill no block
    of 16 outputs, with and without bias and the residual post-op: within the kernel's
    rounding of the exact product of the weight as it holds it (a float64 reference)."""
    kernel = draft_kernel(OneDNNLinear(), dtype)
    assert isinstance(kernel, DraftGemv)
    for rows in (*range(1, MAX_ROWS + 1), MAX_ROWS + 1, 9):
        weight, bias, x, residual = _data(out_features, in_features, rows, rows, dtype)
        if dtype == torch.bfloat16 and in_features % 2:
            continue  # read in pairs: the fallback's (test below)
        b = bias if with_bias else None
        packed = kernel.pack(weight, b)
        # the weight as the kernel holds it: bfloat16 (the f32 kernel rounds it so)
        expected = x.double() @ weight.bfloat16().double().T + (
            b.double() if b is not None else 0)
        out, added = packed(x), packed.add(x, residual)
        assert out.shape == (rows, out_features) and out.dtype == dtype
        assert _max_error(out, expected) < _bound(dtype)
        assert _max_error(added, expected + residual.double()) < _bound(dtype)


@pytest.mark.parametrize("dtype", KERNELS)
def test_gemv_takes_strided_rows(dtype: torch.dtype) -> None:
    """Rows spaced in memory (a view of a wider activation) read as their own values."""
    weight, _, x, _ = _data(64, 128, 3, dtype=dtype)
    wide = torch.cat([x, torch.zeros_like(x)], dim=1)[:, :128]
    assert wide.stride(0) == 256
    packed = draft_kernel(OneDNNLinear(), dtype).pack(weight, None)
    assert torch.equal(packed(wide), packed(x.contiguous()))
    expected = x.double() @ weight.bfloat16().double().T
    assert _max_error(packed(wide), expected) < _bound(dtype)


@needs_gemv
def test_the_check_sees_a_weight_packed_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken on purpose: the two inputs of each lane swapped in the packed weight. The
    comparison above must fail on it."""
    real = linear_draft.pack_pairs
    monkeypatch.setattr(linear_draft, "pack_pairs", lambda w: real(w).flip(-1).contiguous())
    linear_draft.load.cache_clear()  # the kernel holds its pack function
    try:
        weight, _, x, _ = _data(64, 128, 1)
        packed = draft_kernel(OneDNNLinear(), torch.bfloat16).pack(weight, None)
        assert _max_error(packed(x), x.double() @ weight.double().T) > 0.05
    finally:
        linear_draft.load.cache_clear()


@needs_f32_gemv
def test_the_check_sees_an_f32_weight_interleaved_wrong(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Broken on purpose: the f32 kernel's lanes read back in the order they are loaded
    (its widening interleaves outputs 0-3 with 8-11), as a store without the kernel's
    reordering would. Simulated by packing each block's outputs in that order: the
    comparison above must fail on it."""
    real = linear_draft.pack_rows
    order = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])
    monkeypatch.setattr(linear_draft, "pack_rows", lambda w: real(w)[..., order].contiguous())
    linear_draft.load.cache_clear()
    try:
        weight, _, x, _ = _data(64, 128, 1, dtype=torch.float32)
        packed = draft_kernel(OneDNNLinear(), torch.float32).pack(weight, None)
        assert _max_error(packed(x), x.double() @ weight.double().T) > 0.05
    finally:
        linear_draft.load.cache_clear()


def test_the_drafter_kernel_follows_the_target() -> None:
    """Each dtype gets its gemv where it runs, for its small calls; the rest, and every
    call where none runs, unsliced oneDNN where the target runs oneDNN; int8 targets
    keep their own kernel, and so do torch targets for the wide calls."""
    capped = RowCapped(OneDNNLinear(), 32)
    for target in (OneDNNLinear(), capped):
        for dtype in (torch.float32, torch.bfloat16):
            kernel = draft_kernel(target, dtype)
            if linear_draft.load(dtype)[0] is None:
                assert isinstance(kernel, OneDNNLinear) and kernel.max_reduction is None
            else:
                assert isinstance(kernel, DraftGemv) and kernel.gemv.dtype == dtype
                assert isinstance(kernel.inner, OneDNNLinear)
                assert kernel.inner.max_reduction is None
    torch_kernel, int8 = TorchLinear(), Int8DynamicLinear()
    for_torch = draft_kernel(torch_kernel, torch.float32)
    assert for_torch is torch_kernel or (isinstance(for_torch, DraftGemv)
                                         and for_torch.inner is torch_kernel)
    assert draft_kernel(int8, torch.float32) is int8
    # a target on GGUF blocks: a draft model's block weights run from them, a head's
    # on the drafter kernel its inner target gets
    blocks = draft_kernel(BlockLinear(OneDNNLinear()), torch.float32)
    assert isinstance(blocks, BlockLinear)
    assert type(blocks.inner) is type(draft_kernel(OneDNNLinear(), torch.float32))


def test_a_heads_weights_run_from_q8_0_blocks_where_the_target_runs_blocks() -> None:
    """A drafter beside a target on GGUF blocks: a trained head's float32 weight (no
    blocks in it) is rounded to Q8_0 and runs from the blocks, so each output is the
    rounded weight's sum and near the float weight's; a weight whose inputs the kernel
    does not take stays on the drafter's gemv; the target's own kernel never rounds."""
    if not linear_blocks.available():
        pytest.skip(f"no GGUF-block kernel here: {linear_blocks.load()[1]}")
    kernel = draft_kernel(BlockLinear(OneDNNLinear()), torch.float32)
    assert isinstance(kernel, BlockLinear) and kernel.round_others
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 576, generator=gen) * 0.05
    x = torch.randn(3, 576, generator=gen)
    packed = kernel.pack(weight, None)
    assert isinstance(packed, linear_blocks._BlocksPacked) and packed.bits == 8
    out, exact = packed(x), x @ weight.T
    torch.testing.assert_close(out, x @ quantized(weight, 8).T, rtol=1e-5, atol=1e-5)
    assert float((out - exact).abs().max()) < 0.02 * float(exact.abs().max())
    assert not torch.equal(out, exact)  # rounded: not the float weight's sums
    odd = kernel.pack(torch.randn(64, 100, generator=gen), None)
    assert not isinstance(odd, linear_blocks._BlocksPacked)
    target = BlockLinear(OneDNNLinear()).pack(weight, None)
    assert not isinstance(target, linear_blocks._BlocksPacked)


def test_no_kernel_is_claimed_for_another_dtype() -> None:
    """float16 (or anything else) has no gemv: said, not guessed."""
    gemv, why = linear_draft.load(torch.float16)
    assert gemv is None and "float16" in why


def test_unsliced_onednn_computes_a_wide_reduction_in_one_call() -> None:
    """The drafter's fallback: one oneDNN call for a reduction the target's kernel
    slices (1536 inputs), the same linear (float32: oneDNN packs it on every CPU)."""
    weight, _, x, residual = _data(64, 1536, 7, dtype=torch.float32)
    sliced, whole = (OneDNNLinear(cut).pack(weight, None) for cut in (768, None))
    assert isinstance(sliced, _OneDNNPacked) and isinstance(whole, _OneDNNPacked)
    assert len(sliced.packed) == 2 and len(whole.packed) == 1
    expected = x.double() @ weight.double().T
    assert _max_error(whole(x), expected) < 1e-2
    assert _max_error(whole.add(x, residual), expected + residual.double()) < 1e-2


@needs_gemv
def test_weights_the_gemv_cannot_read_keep_the_fallback() -> None:
    """An odd number of inputs (the kernel reads them in pairs) and float32 weights pack
    for the fallback alone, and still compute the linear."""
    kernel = draft_kernel(OneDNNLinear(), torch.bfloat16)
    assert isinstance(kernel, DraftGemv)
    for weight, x in (((torch.randn(32, 63) * 0.05).bfloat16(), torch.randn(2, 63).bfloat16()),
                      (torch.randn(32, 64) * 0.05, torch.randn(2, 64))):
        packed = kernel.pack(weight, None)
        assert not isinstance(packed, linear_draft._GemvPacked)
        assert _max_error(packed(x), x.double() @ weight.double().T) < 1e-2


@needs_f32_gemv
def test_the_f32_kernel_gives_a_row_its_bits_whatever_shares_the_call() -> None:
    """The f32 kernel takes every row count and sums each output in one order, so a
    drafter's split pass (its readout rows alone) drafts from the whole pass's bits:
    the target's row-invariance probe passes it, at the head's widths."""
    kernel = draft_kernel(OneDNNLinear(), torch.float32)
    assert isinstance(kernel, DraftGemv) and kernel.gemv.max_rows is None
    for width in (576, 1536, 1728):
        assert is_row_invariant(kernel, torch.float32, in_features=width), width


@needs_f32_gemv
def test_a_bfloat16_weight_keeps_the_f32_kernels_fallback() -> None:
    """The f32 kernel packs float32 weights only (those of a float32 drafter); a
    bfloat16 one keeps the fallback (`F.linear` here: it packs bfloat16 everywhere)."""
    kernel = draft_kernel(TorchLinear(), torch.float32)
    assert isinstance(kernel, DraftGemv)
    weight, x = (torch.randn(32, 64) * 0.05).bfloat16(), torch.randn(2, 64).bfloat16()
    packed = kernel.pack(weight, None)
    assert not isinstance(packed, linear_draft._GemvPacked)
    assert _max_error(packed(x), x.double() @ weight.double().T) < 1e-2


@pytest.mark.model
@pytest.mark.parametrize("dtype", KERNELS)
def test_an_engines_head_drafts_through_the_gemv(dtype: torch.dtype,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring: an engine in each dtype packs its head's linear layers for that
    dtype's gemv (float32 beside a target on GGUF blocks: as Q8_0 blocks, on the
    target's block kernel), its one-row steps run through it, and greedy output stays
    speculation off's."""
    from engine.llm import LLM
    from runner.model_loader import load_model
    from runner.model_prep import resolve_model
    from scheduler import SamplingParams

    model = load_model(resolve_model(None), dtype, torch.device("cpu"))
    rows: list[int] = []
    real = linear_draft._GemvPacked._run

    def counted(self: linear_draft._GemvPacked, x: torch.Tensor,
                residual: torch.Tensor | None) -> torch.Tensor:
        rows.append(x.shape[0])
        return real(self, x, residual)

    spec = {"method": "eagle", "model": "random", "num_speculative_tokens": 6,
            "draft_top_k": [2, 1], "min_draft_confidence": 0.0}
    on = LLM(loaded_model=model, speculative_config=spec)
    head = on.engine.runner.spec.drafter.net
    if isinstance(model.kernel_choice.kernel, BlockLinear):
        packed = head._lm_head
        assert isinstance(packed, linear_blocks._BlocksPacked) and packed.bits == 8
        run = packed._run  # this layer's calls alone (the target's share the class)

        def counted_blocks(x: torch.Tensor, residual: torch.Tensor | None,
                           bias: bool = True) -> torch.Tensor:
            rows.append(x.shape[0])
            return run(x, residual, bias)

        monkeypatch.setattr(packed, "_run", counted_blocks)
        cap = None
    else:
        monkeypatch.setattr(linear_draft._GemvPacked, "_run", counted)
        assert isinstance(head._lm_head, linear_draft._GemvPacked)
        assert head._lm_head.gemv.dtype == dtype
        cap = head._lm_head.gemv.max_rows
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = ["Name three rivers.", "What is a prime number?"]
    got = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    off = LLM(loaded_model=model)
    want = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert rows and (cap is None or max(rows) <= cap)
