"""A drafter's linear kernel (runner/models/linear_draft.py): the bfloat16 gemv computes
the linear for calls of a few rows, wider calls take the fallback, and the choice
follows the target's kernel and dtype."""

from __future__ import annotations

import pytest
import torch

from runner.models import linear_draft
from runner.models.linear import OneDNNLinear, RowCapped, TorchLinear, _OneDNNPacked
from runner.models.linear_draft import MAX_ROWS, DraftGemv, draft_kernel
from runner.models.linear_int8 import Int8DynamicLinear

needs_gemv = pytest.mark.skipif(
    linear_draft.load()[0] is None,
    reason=f"the drafter's gemv kernel does not run here: {linear_draft.load()[1]}")


def _data(out_features: int, in_features: int, rows: int, seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    residual = torch.randn(rows, out_features, generator=gen).bfloat16()
    return weight, bias, x, residual


def _max_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest error as a fraction of the largest expected value."""
    return ((out.double() - expected).abs().max() / expected.abs().max()).item()


@needs_gemv
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(576, 576), (8192, 576), (100, 64), (33, 1728)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_computes_the_linear(out_features: int, in_features: int,
                                  with_bias: bool) -> None:
    """Every row count to MAX_ROWS and past it (the fallback), sizes that fill no block
    of 16 outputs, with and without bias and the residual post-op: within bfloat16's
    rounding of the exact product (a float64 reference)."""
    kernel = draft_kernel(OneDNNLinear(), torch.bfloat16)
    assert isinstance(kernel, DraftGemv)
    for rows in (*range(1, MAX_ROWS + 1), MAX_ROWS + 1, 9):
        weight, bias, x, residual = _data(out_features, in_features, rows, seed=rows)
        b = bias if with_bias else None
        packed = kernel.pack(weight, b)
        expected = x.double() @ weight.double().T + (b.double() if b is not None else 0)
        out, added = packed(x), packed.add(x, residual)
        assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
        assert _max_error(out, expected) < 1e-2
        assert _max_error(added, expected + residual.double()) < 1e-2


@needs_gemv
def test_gemv_takes_strided_rows() -> None:
    """Rows spaced in memory (a view of a wider activation) read as their own values."""
    weight, _, x, _ = _data(64, 128, 3)
    wide = torch.cat([x, torch.zeros_like(x)], dim=1)[:, :128]
    assert wide.stride(0) == 256
    packed = draft_kernel(OneDNNLinear(), torch.bfloat16).pack(weight, None)
    assert torch.equal(packed(wide), packed(x.contiguous()))
    expected = x.double() @ weight.double().T
    assert _max_error(packed(wide), expected) < 1e-2


@needs_gemv
def test_the_check_sees_a_weight_packed_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken on purpose: the two inputs of each lane swapped in the packed weight. The
    comparison above must fail on it."""
    real = linear_draft.pack_pairs
    monkeypatch.setattr(linear_draft, "pack_pairs", lambda w: real(w).flip(-1).contiguous())
    weight, _, x, _ = _data(64, 128, 1)
    packed = draft_kernel(OneDNNLinear(), torch.bfloat16).pack(weight, None)
    assert _max_error(packed(x), x.double() @ weight.double().T) > 0.05


def test_the_drafter_kernel_follows_the_target() -> None:
    """bfloat16 gets the gemv where it runs; float32 and the rest unsliced oneDNN where
    the target runs oneDNN; int8 and torch targets keep their own kernel."""
    capped = RowCapped(OneDNNLinear(), 32)
    for target in (OneDNNLinear(), capped):
        wide = draft_kernel(target, torch.float32)
        assert isinstance(wide, OneDNNLinear) and wide.max_reduction is None
        bf16 = draft_kernel(target, torch.bfloat16)
        if linear_draft.load()[0] is None:
            assert isinstance(bf16, OneDNNLinear) and bf16.max_reduction is None
        else:
            assert isinstance(bf16, DraftGemv) and isinstance(bf16.inner, OneDNNLinear)
    torch_kernel, int8 = TorchLinear(), Int8DynamicLinear()
    assert draft_kernel(torch_kernel, torch.float32) is torch_kernel
    assert draft_kernel(int8, torch.float32) is int8


def test_unsliced_onednn_computes_a_wide_reduction_in_one_call() -> None:
    """The drafter's fallback: one oneDNN call for a reduction the target's kernel
    slices (1536 inputs), the same linear."""
    weight, _, x, residual = _data(64, 1536, 7)
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


@pytest.mark.model
@needs_gemv
def test_a_bfloat16_engines_head_drafts_through_the_gemv(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring: an engine in bfloat16 packs its head's linear layers for the gemv,
    its one-row steps run through it, and greedy output stays speculation off's."""
    from engine.llm import LLM
    from runner.model_loader import load_model
    from runner.model_prep import resolve_model
    from scheduler import SamplingParams

    model = load_model(resolve_model(None), torch.bfloat16, torch.device("cpu"))
    rows: list[int] = []
    real = linear_draft._GemvPacked._run

    def counted(self: linear_draft._GemvPacked, x: torch.Tensor,
                residual: torch.Tensor | None) -> torch.Tensor:
        rows.append(x.shape[0])
        return real(self, x, residual)

    monkeypatch.setattr(linear_draft._GemvPacked, "_run", counted)
    spec = {"method": "eagle", "model": "random", "num_speculative_tokens": 6,
            "draft_top_k": [2, 1], "min_draft_confidence": 0.0}
    on = LLM(loaded_model=model, speculative_config=spec)
    head = on.engine.runner.spec.drafter.net
    assert isinstance(head._lm_head, linear_draft._GemvPacked)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = ["Name three rivers.", "What is a prime number?"]
    got = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    off = LLM(loaded_model=model)
    want = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert rows and max(rows) <= MAX_ROWS
