"""The fused, chunked LM head + cross-entropy (training/vocab_loss.py) against
`F.cross_entropy` over the same logits: loss, drafted tokens, both gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training import vocab_loss
from training.vocab_loss import head_cross_entropy

IGNORE = -100


def _case(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    normed = torch.randn(rows, 24, generator=gen, requires_grad=True)
    weight = torch.randn(40, 24, generator=gen).mul_(0.3).requires_grad_()
    target = torch.randint(0, 40, (rows,), generator=gen)
    target[1::5] = -1  # a token outside the draft vocabulary: no loss, a miss
    return normed, weight, target


def _reference(normed: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (normed @ weight.t()).float()
    return (F.cross_entropy(logits, torch.where(target >= 0, target, IGNORE),
                            ignore_index=IGNORE), logits.argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 7, 300])  # one chunk, part of one, several
def test_fused_loss_and_gradients_equal_cross_entropy(monkeypatch: pytest.MonkeyPatch,
                                                      rows: int) -> None:
    monkeypatch.setattr(vocab_loss, "CHUNK", 128)
    normed, weight, target = _case(rows)
    loss, drafted = head_cross_entropy(normed, weight, target)
    (loss * 3.0).backward()  # the caller's weight reaches both gradients
    got = normed.grad.clone(), weight.grad.clone()
    normed.grad = weight.grad = None
    want, want_drafted = _reference(normed, weight, target)
    (want * 3.0).backward()
    assert torch.allclose(loss, want, atol=1e-5)
    assert torch.equal(drafted, want_drafted)
    assert torch.allclose(got[0], normed.grad, atol=1e-6)
    assert torch.allclose(got[1], weight.grad, atol=1e-6)


def test_under_bfloat16_autocast_it_matches_the_unfused_loss() -> None:
    normed, weight, target = _case(200, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = head_cross_entropy(normed, weight, target)
        want, _ = _reference(normed, weight, target)
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, want, rtol=1e-3)
    grads = torch.autograd.grad(loss, (normed, weight))
    wants = torch.autograd.grad(want, (normed, weight))
    for got, ref in zip(grads, wants, strict=True):
        assert got.dtype == torch.float32
        assert torch.allclose(got, ref, atol=1e-2 * float(ref.abs().max()))


def test_rows_without_a_known_target_add_no_loss_and_no_gradient() -> None:
    normed, weight, target = _case(10)
    target[:] = -1
    loss, drafted = head_cross_entropy(normed, weight, target)
    assert float(loss.detach()) == 0.0
    assert torch.equal(drafted, (normed @ weight.t()).argmax(dim=-1))
    loss.backward()
    assert normed.grad is None or not normed.grad.any()


def test_without_grad_it_keeps_no_gradient_buffer() -> None:
    normed, weight, target = _case(50)
    with torch.no_grad():
        loss, drafted = head_cross_entropy(normed, weight, target)
    want, want_drafted = _reference(normed.detach(), weight.detach(), target)
    assert torch.allclose(loss, want, atol=1e-5) and torch.equal(drafted, want_drafted)
