"""The head's cross-entropy over the draft vocabulary, fused with its LM head and run
over chunks of rows.

Unfused, an update materialises each step's [rows, draft vocabulary] logits five
times over (the matmul's bfloat16 output, its float32 copy, the log-softmax, its
gradient, that gradient cast back), each ~25 MB at ~800 rows: far past the caches, so
the copies, the softmax and the argmax ran at memory speed (measured: a 7M-element
copy 7-9 ms, the argmax 8 ms where it takes 2.5 ms warm) and took ~15 % of an update.
Here each chunk's float32 logits stay in the cache: the loss, the drafted token and
the gradient of the logits (softmax minus the one-hot target, kept in the matmul's
dtype) come out of one pass over them, and the backward is the two matmuls that
remain. The maths is cross-entropy's; `tests/training/test_vocab_loss.py` checks it
against `F.cross_entropy` over the same logits.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK = 128  # rows: a chunk's float32 logits over 8,192 draft tokens are 4 MB


def matmul_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of `tensor` runs in here: autocast's where it is on."""
    device = tensor.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensor.dtype


class ChunkedCrossEntropy(torch.autograd.Function):
    """(mean cross-entropy of `normed @ weight.T` against `target` over the rows whose
    target is >= 0, the argmax of every row); a row whose target is negative (no label,
    or a token outside the draft vocabulary) adds no loss and no gradient."""

    @staticmethod
    def forward(ctx: Any, normed: torch.Tensor, weight: torch.Tensor,
                target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        known = target >= 0
        count = int(known.sum())
        safe = target.clamp(min=0)
        need_grad = bool(ctx.needs_input_grad[0] or ctx.needs_input_grad[1]) and count > 0
        grads = (torch.empty(len(normed), len(weight), dtype=normed.dtype, device=normed.device)
                 if need_grad else None)
        drafted = torch.empty(len(normed), dtype=torch.int64, device=normed.device)
        total = torch.zeros((), dtype=torch.float32, device=normed.device)
        for start in range(0, len(normed), CHUNK):
            rows = slice(start, start + CHUNK)
            logits = torch.mm(normed[rows], weight.t()).float()
            drafted[rows] = logits.argmax(dim=-1)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[rows, None]).squeeze(1)
            mask = known[rows]
            total += torch.where(mask, lse - picked, 0.0).sum()
            if grads is not None:
                probs = logits.sub_(lse[:, None]).exp_()  # the softmax, in place
                probs.scatter_add_(1, safe[rows, None], -mask[:, None].float())
                grads[rows] = probs.mul_(mask[:, None])
        ctx.mark_non_differentiable(drafted)
        ctx.count = max(count, 1)
        ctx.save_for_backward(normed, weight, grads if grads is not None else normed[:0])
        return total / ctx.count, drafted

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _: Any
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        normed, weight, grads = ctx.saved_tensors
        if grads.numel() == 0:  # nothing scored: no gradient
            return None, None, None
        scale = grad_loss / ctx.count
        grad_normed = (torch.mm(grads, weight).float() * scale).to(normed.dtype)
        # Scaled on the narrow side: [rows, H], not the [vocabulary, H] product.
        grad_weight = torch.mm(grads.t(), (normed.float() * scale).to(normed.dtype))
        return grad_normed, grad_weight.to(weight.dtype), None


def head_cross_entropy(normed: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`ChunkedCrossEntropy` of the head's normed hidden states [M, H] through its LM
    head `weight` [draft vocabulary, H], in the dtype the matmul would run in (under
    bfloat16 autocast: bfloat16 operands, float32 logits, as unfused). A caller that
    scores several steps casts the weight once (`matmul_dtype`): each cast of 8,192 x
    576 and its gradient's cast back cost ~2 ms."""
    dtype = matmul_dtype(normed)
    with torch.autocast(normed.device.type, enabled=False):
        loss, drafted = ChunkedCrossEntropy.apply(normed.to(dtype), weight.to(dtype), target)
    return loss, drafted
