"""Rejection sampler: verifies a step's draft tokens against the target model, losslessly.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023). A request drafts s
tokens x_1..x_s from the drafter's distribution q; the target model scores all of them
in one pass, giving s + 1 rows of logits: row j verifies draft j, the last row (the
bonus row) follows the last draft. Walking the drafts left to right:

  * draft x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j));
  * at the first rejection the walk stops and emits a recovered token drawn from
    normalise(max(p_j - q_j, 0)) (the part of p that q under-covers);
  * if all s are accepted, a bonus token is drawn from the bonus row's p.

Each emitted token is then distributed exactly as p at its position, whatever q is.
Greedy requests (temperature 0) are the limit case: accept while the draft is the
target's argmax, and emit the argmax at the first mismatch or at the bonus row.

The work splits in three so that the GPU path can share everything but the walk:
`DraftLayout` (index maths), `draw_random` (every random number of the step, keyed by
(seed, position) where seeded) and `verify` (the accept/reject walk, given
those numbers). `TritonRejectionSampler` (spec_decode/triton_rejection.py) overrides
only `verify`, so both paths can be fed identical random inputs and compared exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spec_decode.sampling import (
    SAMPLING_EPS,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    exponential_race,
    greedy_ids,
    position_seed,
)

# Fills the unused tail of each request's output row.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class DraftLayout:
    """Where each request's drafts and target rows sit in the flattened batch.

    Drafts are flattened request after request; target rows are each request's s_i
    verifying rows then its bonus row. Worked example, num_draft_tokens = [2, 0, 3]:
      cu_num_draft_tokens = [0, 2, 2, 5]        drafts of request i: [cu[i], cu[i + 1])
      req_of_draft        = [0, 0, 2, 2, 2]     np.repeat(arange(R), s)
      pos_of_draft        = [0, 1, 0, 1, 2]     d - cu[req_of_draft[d]]
      target rows         = [v00, v01, b0, b1, v20, v21, v22, b2]
      draft_rows          = [0, 1, 4, 5, 6]     d + req_of_draft[d]: each earlier request's
                                                bonus row shifts the draft down by one
      bonus_rows          = [2, 3, 7]           cu[i + 1] + i
      req_of_row          = [0, 0, 0, 1, 2, 2, 2, 2]   np.repeat(arange(R), s + 1)
    """

    num_draft_tokens: list[int]
    cu_host: np.ndarray  # [R + 1] int64, host copy for slicing without a device sync
    max_spec_len: int
    cu_num_draft_tokens: torch.Tensor  # [R + 1] int64
    req_of_draft: torch.Tensor  # [D] int64
    pos_of_draft: torch.Tensor  # [D] int64
    draft_rows: torch.Tensor  # [D] int64
    bonus_rows: torch.Tensor  # [R] int64
    req_of_row: torch.Tensor  # [D + R] int64

    @classmethod
    def build(cls, num_draft_tokens: list[int], device: torch.device | str) -> DraftLayout:
        """Computed on the host with numpy, then copied to `device` once."""
        num_drafts = np.asarray(num_draft_tokens, dtype=np.int64).reshape(-1)  # [R]
        if (num_drafts < 0).any():
            raise ValueError(f"negative draft count in {num_draft_tokens}")
        num_reqs = num_drafts.size
        reqs = np.arange(num_reqs, dtype=np.int64)
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_drafts, out=cu[1:])
        req_of_draft = np.repeat(reqs, num_drafts)
        flat = np.arange(cu[-1], dtype=np.int64)

        def dev(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        return cls(
            num_draft_tokens=[int(s) for s in num_drafts],
            cu_host=cu,
            max_spec_len=int(num_drafts.max(initial=0)),
            cu_num_draft_tokens=dev(cu),
            req_of_draft=dev(req_of_draft),
            pos_of_draft=dev(flat - cu[req_of_draft]),
            draft_rows=dev(flat + req_of_draft),
            bonus_rows=dev(cu[1:] + reqs),
            req_of_row=dev(np.repeat(reqs, num_drafts + 1)),
        )

    @property
    def num_reqs(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def total_drafts(self) -> int:
        """Draft tokens of all requests together."""
        return int(self.cu_host[-1])


@dataclass
class RandomDraws:
    """Every random number one verification step uses, drawn before the walk.

    Recovered tokens are drawn for every draft position (only the one at a request's
    first rejection is ever emitted), so the walk itself needs no randomness.
    """

    uniforms: torch.Tensor  # [D] fp32 in [0, 1): draft d is accepted iff p > u * q
    recovered_token_ids: torch.Tensor  # [D] int64, from normalise(max(p - q, 0))
    bonus_token_ids: torch.Tensor  # [R] int64, from p of the bonus row


class RejectionSampler:
    """Torch reference: verifies drafts for a batch of requests (the CPU runtime path).

    `forward` returns [R, max_s + 1] int64: row i holds request i's accepted drafts,
    then one recovered or bonus token, then PLACEHOLDER_TOKEN_ID padding.
    Random rows use the same temperature / top-k / top-p / min-p as `runner.sampler`,
    so a request's distribution does not change when speculative decoding is on.
    """

    def forward(
        self,
        draft_token_ids: torch.Tensor,  # [D] int64
        num_draft_tokens: list[int],  # [R], s_i >= 0
        draft_probs: torch.Tensor | None,  # [D, V] fp32; None = one-hot q at the draft
        target_logits: torch.Tensor,  # [D + R, V] fp32
        sampling: SamplingMetadata,  # R rows
    ) -> torch.Tensor:
        layout = DraftLayout.build(num_draft_tokens, target_logits.device)
        _check_shapes(layout, draft_token_ids, draft_probs, target_logits, sampling)
        target_argmax = greedy_ids(target_logits)  # [D + R]; temperature keeps argmax
        target_probs = None
        draws = None
        if not sampling.all_greedy:
            target_probs = compute_target_probs(target_logits, sampling, layout.req_of_row)
            draws = draw_random(layout, draft_token_ids, draft_probs, target_probs,
                                sampling.seeds, sampling.positions)
        is_greedy = sampling.temperature < SAMPLING_EPS  # [R] bool
        return self.verify(layout, draft_token_ids, draft_probs, target_argmax,
                           target_probs, draws, is_greedy, all_random=sampling.all_random)

    __call__ = forward

    def verify(
        self,
        layout: DraftLayout,
        draft_token_ids: torch.Tensor,  # [D] int64
        draft_probs: torch.Tensor | None,  # [D, V] fp32
        target_argmax: torch.Tensor,  # [D + R] int64
        target_probs: torch.Tensor | None,  # [D + R, V] fp32; None when all rows are greedy
        draws: RandomDraws | None,  # None when all rows are greedy
        is_greedy: torch.Tensor,  # [R] bool
        all_random: bool = False,  # host-side summary of is_greedy: skips the greedy rule
    ) -> torch.Tensor:
        """The accept/reject walk, vectorised over all drafts: [R, max_s + 1] int64.

        Greedy rows take the argmax rule, the others the random rule with `draws`.
        """
        target_at_draft = target_argmax[layout.draft_rows]  # [D]
        accepted = draft_token_ids == target_at_draft  # greedy rule
        recovered = target_at_draft
        bonus = target_argmax[layout.bonus_rows]  # [R]
        if target_probs is not None and draws is not None:
            drafts = draft_token_ids.unsqueeze(1)  # [D, 1]
            p = target_probs[layout.draft_rows].gather(1, drafts).squeeze(1)  # [D]
            q = 1.0 if draft_probs is None else draft_probs.gather(1, drafts).squeeze(1)
            # u < p / q without dividing: p = 0 never accepts, q = 0 < p always does.
            random_accepted = p > draws.uniforms * q
            if all_random:
                return assemble_output(layout, draft_token_ids, random_accepted,
                                       draws.recovered_token_ids, draws.bonus_token_ids)
            greedy_draft = is_greedy[layout.req_of_draft]  # [D]
            accepted = torch.where(greedy_draft, accepted, random_accepted)
            recovered = torch.where(greedy_draft, recovered, draws.recovered_token_ids)
            bonus = torch.where(is_greedy, bonus, draws.bonus_token_ids)
        return assemble_output(layout, draft_token_ids, accepted, recovered, bonus)


def greedy_walk(drafts: list[list[int]], target_ids: list[int]) -> list[list[int]]:
    """The greedy rule for a step whose every request is greedy, on the host: each
    request's accepted drafts, then the target's pick at its first mismatch or at its
    bonus row. `target_ids`: each target row's argmax, rows laid out as `DraftLayout`
    lays them (a request's s verifying rows, then its bonus row).

    `RejectionSampler.forward`'s result for such a step, as lists: an accepted draft is
    the target's pick at its row, so emitting the picks emits the drafts. Its ~7 small
    device copies and ~15 tensor ops cost ~1 ms a step on the CPU at one request, a
    thirtieth of a decode step; this walk costs microseconds."""
    need = sum(map(len, drafts)) + len(drafts)
    if len(target_ids) != need:
        raise ValueError(f"target_ids has {len(target_ids)} rows, expected {need}: one per "
                         f"draft plus a bonus row per request")
    emitted: list[list[int]] = []
    row = 0
    for draft in drafts:
        picks = target_ids[row:row + len(draft) + 1]
        taken = 0
        while taken < len(draft) and draft[taken] == picks[taken]:
            taken += 1
        emitted.append(picks[:taken + 1])
        row += len(draft) + 1
    return emitted


def compute_target_probs(
    target_logits: torch.Tensor,  # [T, V] fp32
    sampling: SamplingMetadata,  # R rows
    req_of_row: torch.Tensor,  # [T] int64: the request each target row belongs to
) -> torch.Tensor:
    """p for every target row: softmax of logits / T after top-k, top-p and min-p.

    The same steps as `Sampler._sample_random`; greedy rows use T = 1 (unused).
    """
    temperature = sampling.temperature[req_of_row]  # [T]
    temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
    logits = target_logits / temperature.unsqueeze(1)  # a copy: the input stays intact
    if not (sampling.no_top_k and sampling.no_top_p):
        logits = apply_top_k_top_p(logits, sampling.top_k[req_of_row], sampling.top_p[req_of_row])
    if not sampling.no_min_p:
        logits = apply_min_p(logits, sampling.min_p[req_of_row])
    return torch.softmax(logits, dim=-1)


def draw_random(
    layout: DraftLayout,
    draft_token_ids: torch.Tensor,  # [D] int64
    draft_probs: torch.Tensor | None,  # [D, V] fp32; None = one-hot q
    target_probs: torch.Tensor,  # [D + R, V] fp32
    seeds: dict[int, int],  # request row -> its seed
    positions: np.ndarray | None = None,  # [R] int64: each request's first row's position
) -> RandomDraws:
    """Uniforms, recovered tokens and bonus tokens for every request of the step.

    Unseeded requests share the global stream. A seeded request's draws are keyed by
    (seed, position) instead (`_seeded_draws`), so its tokens never depend on the batch
    nor on how many drafts it verifies.
    """
    uniforms = torch.rand(layout.total_drafts, dtype=torch.float32,
                          device=target_probs.device)  # [D]
    p_at_drafts = target_probs[layout.draft_rows]  # [D, V]
    if draft_probs is None:
        # q is one-hot at x and p(x) <= 1, so max(p - q, 0) is p with x zeroed.
        residual = p_at_drafts.scatter(1, draft_token_ids.unsqueeze(1), 0.0)
    else:
        residual = (p_at_drafts - draft_probs).clamp_min_(0.0)
    # An all-zero residual means p <= q everywhere, i.e. p == q: the draft is then always
    # accepted and this token never emitted, but it must still be a valid draw from p.
    empty = ~(residual > 0).any(dim=-1, keepdim=True)  # [D, 1]
    residual = torch.where(empty, p_at_drafts, residual)
    # The race is argmax(residual / Exp(1)), invariant to the row's scale: no normalising.
    recovered = exponential_race(residual, {})  # [D]
    bonus = exponential_race(target_probs[layout.bonus_rows], {})  # [R]
    draws = RandomDraws(uniforms=uniforms, recovered_token_ids=recovered, bonus_token_ids=bonus)
    for req, seed in seeds.items():
        position = 0 if positions is None else int(positions[req])
        _seeded_draws(draws, layout, req, seed, position, draft_token_ids,
                      draft_probs, target_probs, residual)
    return draws


def _seeded_draws(draws: RandomDraws, layout: DraftLayout, req: int, seed: int,
                  position: int, draft_token_ids: torch.Tensor,
                  draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                  residual: torch.Tensor) -> None:
    """Overwrite request `req`'s draws with ones keyed by (seed, position).

    With one-hot q (every drafter here drafts greedily) the draws are coupled to what
    the sampler would emit: each of the request's rows j races p_j against the noise of
    position + j, giving y_j. Draft x_j is accepted iff y_j == x_j (probability p(x_j),
    as the rule asks), and a rejected draft's recovered token is y_j, which is exactly
    the residual race under the same noise. So every emitted token is y_j: the same
    token speculation off would sample, whatever was drafted.
    """
    first, last = int(layout.cu_host[req]), int(layout.cu_host[req + 1])
    rows = [first + req + j for j in range(last - first + 1)]  # its s target rows + bonus
    keys = {i: (seed, position + i) for i in range(len(rows))}
    if draft_probs is None:
        raced = exponential_race(target_probs[rows], keys)  # [s + 1]
        hit = raced[:-1] == draft_token_ids[first:last]
        draws.uniforms[first:last] = torch.where(hit, 0.0, 1.0)
        draws.recovered_token_ids[first:last] = raced[:-1]
    else:
        for j in range(last - first):
            gen = torch.Generator(device=target_probs.device)
            gen.manual_seed(position_seed(seed, position + j) ^ 1)  # its own stream
            draws.uniforms[first + j] = torch.rand((), generator=gen,
                                                   device=target_probs.device)
        draws.recovered_token_ids[first:last] = exponential_race(
            residual[first:last], {j: keys[j] for j in range(last - first)})
        raced = exponential_race(target_probs[rows[-1:]], {0: keys[last - first]})
    draws.bonus_token_ids[req] = raced[-1]


def assemble_output(
    layout: DraftLayout,
    draft_token_ids: torch.Tensor,  # [D] int64
    accepted: torch.Tensor,  # [D] bool
    recovered: torch.Tensor,  # [D] int64, the token emitted if draft d is the first rejected
    bonus: torch.Tensor,  # [R] int64, the token emitted if all of request i's drafts pass
) -> torch.Tensor:
    """Accepted drafts, then the recovered or bonus token, then padding: [R, max_s + 1].

    Scatter the flat drafts into a padded grid where request i's draft j sits at [i, j]
    and its bonus at [i, s_i]; the first "stop" per row is its first rejected draft, or
    the bonus column. Worked example, s = [2, 0, 3], accepted = [T, T | - | T, F, T]:
      stop = [[F, F, T, T],     num_accepted = first stop = [2, 0, 1]
              [T, T, T, T],     out = [[x00, x01, bonus0, -1],
              [F, T, F, T]]            [bonus1, -1, -1, -1],
                                       [x20, rec21, -1, -1]]
    (the accepted draft after a rejection, x22, is ignored).
    """
    num_reqs, width = layout.num_reqs, layout.max_spec_len + 1
    device = draft_token_ids.device
    rows, cols = layout.req_of_draft, layout.pos_of_draft
    reqs = torch.arange(num_reqs, device=device)
    num_drafts = layout.cu_num_draft_tokens.diff()  # [R]

    stop = torch.ones(num_reqs, width, dtype=torch.bool, device=device)
    stop[rows, cols] = ~accepted
    num_accepted = stop.to(torch.int32).argmax(dim=1)  # [R]; argmax takes the first max

    drafts = torch.full((num_reqs, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                        device=device)
    drafts[rows, cols] = draft_token_ids
    emitted = torch.empty_like(drafts)  # the token to emit if the walk stops at [i, j]
    emitted[rows, cols] = recovered
    emitted[reqs, num_drafts] = bonus

    positions = torch.arange(width, device=device)
    out = torch.where(positions < num_accepted.unsqueeze(1), drafts, PLACEHOLDER_TOKEN_ID)
    last = num_accepted.unsqueeze(1)  # [R, 1]
    return out.scatter_(1, last, emitted.gather(1, last))


def _check_shapes(layout: DraftLayout, draft_token_ids: torch.Tensor,
                  draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                  sampling: SamplingMetadata) -> None:
    """Shape checks only (host metadata, no device sync)."""
    num_drafts, num_reqs = layout.total_drafts, layout.num_reqs
    if draft_token_ids.shape != (num_drafts,):
        raise ValueError(f"draft_token_ids has shape {tuple(draft_token_ids.shape)}, "
                         f"expected ({num_drafts},) = sum(num_draft_tokens)")
    if target_logits.dim() != 2 or target_logits.shape[0] != num_drafts + num_reqs:
        raise ValueError(f"target_logits has shape {tuple(target_logits.shape)}, expected "
                         f"({num_drafts + num_reqs}, V): one row per draft plus a bonus "
                         f"row per request")
    if draft_probs is not None and draft_probs.shape != (num_drafts, target_logits.shape[1]):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected "
                         f"({num_drafts}, {target_logits.shape[1]})")
    if sampling.temperature.shape != (num_reqs,):
        raise ValueError(f"sampling has {sampling.temperature.shape[0]} rows, "
                         f"expected {num_reqs} (one per request)")
