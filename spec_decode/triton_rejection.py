"""Rejection sampling in Triton: the GPU path, tested against the torch reference.

Only the accept/reject walk runs in Triton. Everything random (uniforms, recovered and
bonus tokens) is drawn by the torch code in spec_decode/rejection_sampler.py, so both
paths consume identical inputs and must agree token for token. Recovered tokens are
drawn for every draft with the exponential race outside the kernels: a few elementwise
passes over [D, V] probabilities, which is cheap next to the target forward pass.

One program per request walks its drafts in order and stops at the first rejection:
a greedy kernel (compare with the target argmax) and a random kernel (gather p(x) and
q(x), compare with the uniform). In a mixed batch each kernel skips the other's rows;
the output starts as all PLACEHOLDER_TOKEN_ID, so positions after the stop stay padding.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    DraftLayout,
    RandomDraws,
    RejectionSampler,
)


# Kernel arguments stay unannotated: Triton reads annotations as specialisation hints.
@triton.jit
def _greedy_verify_kernel(  # type: ignore[no-untyped-def]
    out_ptr, draft_ids_ptr, target_argmax_ptr, cu_num_drafts_ptr, is_greedy_ptr,
    stride_out,
    SKIP_RANDOM_ROWS: tl.constexpr,
):
    req = tl.program_id(0)
    if SKIP_RANDOM_ROWS:  # noqa: SIM102 - a constexpr branch: no load when off
        if not tl.load(is_greedy_ptr + req):
            return
    start = tl.load(cu_num_drafts_ptr + req)  # request's first draft, flat index
    end = tl.load(cu_num_drafts_ptr + req + 1)
    # Target row of flat draft d is d + req: each earlier request adds one bonus row.
    rejected = False
    for j in range(end - start):
        if not rejected:
            draft = tl.load(draft_ids_ptr + start + j)
            target = tl.load(target_argmax_ptr + start + req + j)
            # Accepted: target == draft; rejected: target is the recovered token.
            tl.store(out_ptr + req * stride_out + j, target)
            if draft != target:
                rejected = True
    if not rejected:
        bonus = tl.load(target_argmax_ptr + end + req)
        tl.store(out_ptr + req * stride_out + end - start, bonus)


@triton.jit
def _random_verify_kernel(  # type: ignore[no-untyped-def]
    out_ptr, draft_ids_ptr, draft_probs_ptr, target_probs_ptr,
    uniforms_ptr, recovered_ptr, bonus_ptr, cu_num_drafts_ptr, is_greedy_ptr,
    stride_out, stride_draft_probs, stride_target_probs,
    SKIP_GREEDY_ROWS: tl.constexpr, ONE_HOT_DRAFTS: tl.constexpr,
):
    req = tl.program_id(0)
    if SKIP_GREEDY_ROWS:  # noqa: SIM102 - a constexpr branch: no load when off
        if tl.load(is_greedy_ptr + req):
            return
    start = tl.load(cu_num_drafts_ptr + req)
    end = tl.load(cu_num_drafts_ptr + req + 1)
    rejected = False
    for j in range(end - start):
        if not rejected:
            d = start + j
            draft = tl.load(draft_ids_ptr + d)
            p = tl.load(target_probs_ptr + (d + req) * stride_target_probs + draft)
            if ONE_HOT_DRAFTS:  # noqa: SIM108 - resolved at compile time
                q = 1.0
            else:
                q = tl.load(draft_probs_ptr + d * stride_draft_probs + draft)
            u = tl.load(uniforms_ptr + d)
            # u < p / q without dividing, the same comparison as the torch reference.
            if p > u * q:
                tl.store(out_ptr + req * stride_out + j, draft)
            else:
                rejected = True
                tl.store(out_ptr + req * stride_out + j, tl.load(recovered_ptr + d))
    if not rejected:
        tl.store(out_ptr + req * stride_out + end - start, tl.load(bonus_ptr + req))


class TritonRejectionSampler(RejectionSampler):
    """The same `forward` as `RejectionSampler`, with the walk in Triton (CUDA).

    Runs on CPU tensors too under TRITON_INTERPRET=1, which the tests use.
    """

    def verify(
        self,
        layout: DraftLayout,
        draft_token_ids: torch.Tensor,  # [D] int64
        draft_probs: torch.Tensor | None,  # [D, V] fp32
        target_argmax: torch.Tensor,  # [D + R] int64
        target_probs: torch.Tensor | None,  # [D + R, V] fp32
        draws: RandomDraws | None,
        is_greedy: torch.Tensor,  # [R] bool
        all_random: bool = False,
    ) -> torch.Tensor:
        num_reqs = layout.num_reqs
        out = torch.full((num_reqs, layout.max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                         dtype=torch.int64, device=draft_token_ids.device)
        if num_reqs == 0:
            return out
        draft_token_ids = draft_token_ids.contiguous()
        cu = layout.cu_num_draft_tokens
        has_random = target_probs is not None and draws is not None
        grid = (num_reqs,)
        if not (has_random and all_random):
            _greedy_verify_kernel[grid](
                out, draft_token_ids, target_argmax.contiguous(), cu, is_greedy,
                out.stride(0),
                SKIP_RANDOM_ROWS=has_random,
            )
        if target_probs is not None and draws is not None:
            target_probs = target_probs.contiguous()
            if draft_probs is not None:
                draft_probs = draft_probs.contiguous()
            _random_verify_kernel[grid](
                out, draft_token_ids,
                # Any tensor stands in for the unused pointer; the constexpr skips it.
                target_probs if draft_probs is None else draft_probs,
                target_probs, draws.uniforms.contiguous(),
                draws.recovered_token_ids.contiguous(), draws.bonus_token_ids.contiguous(),
                cu, is_greedy,
                out.stride(0),
                0 if draft_probs is None else draft_probs.stride(0),
                target_probs.stride(0),
                SKIP_GREEDY_ROWS=not all_random,
                ONE_HOT_DRAFTS=draft_probs is None,
            )
        return out
