"""Rejection sampler: greedy walks, lossless distribution, seeds, Triton against torch."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from scheduler.request import SamplingParams
from spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    DraftLayout,
    RandomDraws,
    RejectionSampler,
    draw_random,
    greedy_walk,
)
from spec_decode.sampling import SamplingMetadata, exponential_race
from tests.sampling_helpers import chi2_critical, chi2_statistic, sampling_metadata

VOCAB = 8
NEG_INF = float("-inf")


def metadata(temperatures: list[float], seeds: dict[int, int] | None = None,
             device: str = "cpu", **params: float) -> SamplingMetadata:
    return sampling_metadata(
        [SamplingParams(temperature=t, **params) for t in temperatures],  # type: ignore[arg-type]
        seeds, device=device)


def peaked_logits(argmaxes: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """One row per entry, its argmax at that token."""
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def only(tokens: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """Rows whose p (at any temperature) is one-hot at the given token: -inf elsewhere."""
    logits = torch.full((len(tokens), vocab), NEG_INF)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return logits


def verify(drafts: list[int], num_drafts: list[int], logits: torch.Tensor,
           meta: SamplingMetadata, draft_probs: torch.Tensor | None = None,
           sampler: RejectionSampler | None = None) -> list[list[int]]:
    out = (sampler or RejectionSampler())(
        torch.tensor(drafts, dtype=torch.int64), num_drafts, draft_probs, logits, meta)
    return out.tolist()


# --- greedy ---------------------------------------------------------------------------

@pytest.mark.parametrize(("argmaxes", "want"), [
    ([1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted -> bonus
    ([5, 2, 3, 4], [5, -1, -1, -1]),  # first rejected -> recovered argmax
    ([1, 6, 3, 4], [1, 6, -1, -1]),  # middle rejection; a later match is ignored
    ([1, 2, 0, 4], [1, 2, 0, -1]),  # last rejected
])
def test_greedy_walk(argmaxes: list[int], want: list[int]) -> None:
    assert verify([1, 2, 3], [3], peaked_logits(argmaxes), metadata([0.0])) == [want]
    # The host walk an all-greedy step takes (runner/spec.py) emits the same tokens.
    assert greedy_walk([[1, 2, 3]], argmaxes) == [[t for t in want if t >= 0]]


@pytest.mark.parametrize("seed", range(6))
def test_host_greedy_walk_matches_the_sampler(seed: int) -> None:
    """Random batches whose drafts match the target's picks for a random stretch:
    the host walk emits what `RejectionSampler.forward` emits, request by request."""
    gen = np.random.default_rng(seed)
    num_drafts = gen.integers(0, 5, size=int(gen.integers(1, 9))).tolist()
    picks = gen.integers(0, VOCAB, size=sum(num_drafts) + len(num_drafts)).tolist()
    drafts, row = [], 0
    for s in num_drafts:
        matched = int(gen.integers(0, s + 1))
        drafts.append(picks[row:row + matched] + [(t + 1) % VOCAB for t in
                                                   picks[row + matched:row + s]])
        row += s + 1
    logits = peaked_logits(picks)
    want = verify([t for d in drafts for t in d], num_drafts, logits,
                  metadata([0.0] * len(num_drafts)))
    assert greedy_walk(drafts, picks) == [[t for t in w if t >= 0] for w in want]
    with pytest.raises(ValueError, match="expected"):  # a row short: refused, as forward does
        greedy_walk(drafts, picks[:-1])


def test_greedy_rows_without_drafts_emit_the_bonus_argmax() -> None:
    # s = [0, 2, 0]: rows are b0 | v10, v11, b1 | b2.
    logits = peaked_logits([7, 4, 5, 6, 3])
    got = verify([4, 1], [0, 2, 0], logits, metadata([0.0] * 3))
    assert got == [[7, -1, -1], [4, 5, -1], [3, -1, -1]]
    assert verify([], [0], peaked_logits([2]), metadata([0.0])) == [[2]]


def test_mixed_batch_of_greedy_and_random_rows() -> None:
    # Random rows with one-hot p are deterministic: a draft at p's token is always
    # accepted, any other always rejected and recovered to p's token.
    logits = torch.cat([
        peaked_logits([1, 6, 3]),  # greedy, drafts [1, 2]: reject at 1 -> 6
        only([5, 5, 2]),  # random, drafts [5, 5]: all accepted, bonus 2
        peaked_logits([0]),  # greedy, no drafts: bonus 0
        only([3, 4]),  # random, draft [6] (p(6) = 0): rejected -> 3
    ])
    drafts, num_drafts = [1, 2, 5, 5, 6], [2, 2, 0, 1]
    meta = metadata([0.0, 0.8, 0.0, 1.3])
    want = [[1, 6, -1], [5, 5, 2], [0, -1, -1], [3, -1, -1]]
    assert verify(drafts, num_drafts, logits, meta) == want
    draft_probs = torch.full((5, VOCAB), 1.0 / VOCAB)
    assert verify(drafts, num_drafts, logits, meta, draft_probs) == want


def test_empty_batch_and_shape_errors() -> None:
    out = RejectionSampler()(torch.empty(0, dtype=torch.int64), [], None,
                             torch.empty(0, VOCAB), metadata([]))
    assert out.shape == (0, 1)
    with pytest.raises(ValueError, match="target_logits"):
        verify([1, 2], [2], peaked_logits([1, 2]), metadata([0.0]))
    with pytest.raises(ValueError, match="draft_token_ids"):
        verify([1], [2], peaked_logits([1, 2, 3]), metadata([0.0]))


def test_layout_index_maths() -> None:
    layout = DraftLayout.build([2, 0, 3], "cpu")
    assert layout.cu_num_draft_tokens.tolist() == [0, 2, 2, 5]
    assert layout.req_of_draft.tolist() == [0, 0, 2, 2, 2]
    assert layout.pos_of_draft.tolist() == [0, 1, 0, 1, 2]
    assert layout.draft_rows.tolist() == [0, 1, 4, 5, 6]
    assert layout.bonus_rows.tolist() == [2, 3, 7]
    assert layout.req_of_row.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert layout.max_spec_len == 3


def loop_reference(layout: DraftLayout, drafts: torch.Tensor, accepted: torch.Tensor,
                   recovered: torch.Tensor, bonus: torch.Tensor) -> list[list[int]]:
    """The walk written as the papers do, one request and one draft at a time."""
    rows = []
    for req, num in enumerate(layout.num_draft_tokens):
        start = int(layout.cu_host[req])
        row: list[int] = []
        for d in range(start, start + num):
            if not accepted[d]:
                row.append(int(recovered[d]))
                break
            row.append(int(drafts[d]))
        else:
            row.append(int(bonus[req]))
        rows.append(row + [PLACEHOLDER_TOKEN_ID] * (layout.max_spec_len + 1 - len(row)))
    return rows


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_walk_matches_a_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_drafts = torch.randint(0, 5, (7,), generator=gen).tolist()
    layout = DraftLayout.build(num_drafts, "cpu")
    num_total = layout.total_drafts
    drafts = torch.randint(0, VOCAB, (num_total,), generator=gen)
    target_probs = torch.softmax(torch.randn(num_total + 7, VOCAB, generator=gen), dim=-1)
    draws = RandomDraws(
        uniforms=torch.rand(num_total, generator=gen),
        recovered_token_ids=torch.randint(0, VOCAB, (num_total,), generator=gen),
        bonus_token_ids=torch.randint(0, VOCAB, (7,), generator=gen),
    )
    out = RejectionSampler().verify(layout, drafts, None, target_probs.argmax(-1),
                                    target_probs, draws, torch.zeros(7, dtype=torch.bool),
                                    all_random=True)
    p = target_probs[layout.draft_rows].gather(1, drafts.unsqueeze(1)).squeeze(1)
    want = loop_reference(layout, drafts, p > draws.uniforms, draws.recovered_token_ids,
                          draws.bonus_token_ids)
    assert out.tolist() == want


# --- distribution ---------------------------------------------------------------------

TRIALS = 20_000
NUM_SPEC = 2


def run_trials(p: torch.Tensor, q: torch.Tensor | None, p_bonus: torch.Tensor,
               sampler: RejectionSampler, one_hot_draft: int = 0, seed: int = 0,
               **params: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TRIALS identical requests with NUM_SPEC drafts from q (or the fixed one-hot draft).

    The target logits are log p at each verifying row and log p_bonus at the bonus row,
    so at temperature 1 without filters the target distributions are exactly p, p_bonus.
    Returns the output [TRIALS, NUM_SPEC + 1] and the drafts [TRIALS, NUM_SPEC].
    """
    gen = torch.Generator().manual_seed(seed)
    num_total = TRIALS * NUM_SPEC
    if q is None:
        drafts = torch.full((num_total,), one_hot_draft, dtype=torch.int64)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, num_total, replacement=True, generator=gen)
        draft_probs = q.expand(num_total, -1).contiguous()
    row = torch.stack([p.log()] * NUM_SPEC + [p_bonus.log()])  # [NUM_SPEC + 1, V]
    logits = row.repeat(TRIALS, 1)
    meta = metadata([params.pop("temperature", 1.0)] * TRIALS, **params)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        out = sampler(drafts, [NUM_SPEC] * TRIALS, draft_probs, logits, meta)
    return out, drafts.view(TRIALS, NUM_SPEC)


def dist(*weights: float) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float32)
    return w / w.sum()


def random_dist(seed: int, scale: float = 1.2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(VOCAB, generator=gen) * scale, dim=-1)


P_FULL = dist(3, 1, 2, 9, 4, 1, 2, 3)
PAIRS = {  # name -> (p, q or None = one-hot draft at token 3)
    "p_equals_q": (P_FULL, P_FULL),
    "disjoint": (dist(4, 1, 2, 3, 0, 0, 0, 0), dist(0, 0, 0, 0, 1, 2, 3, 4)),
    "one_hot_draft": (P_FULL, None),
    "random": (random_dist(11), random_dist(12)),
    "partial_overlap": (dist(5, 3, 2, 0, 0, 1, 4, 0), dist(0, 1, 4, 2, 3, 1, 0, 5)),
}


def check_fits(tokens: torch.Tensor, expected: torch.Tensor, alpha: float = 1e-3) -> None:
    df = int((expected > 0).sum()) - 1
    statistic = chi2_statistic(tokens, expected)
    assert statistic < chi2_critical(df, alpha), (statistic, tokens.bincount(minlength=VOCAB))


def emitted_by_position(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens at position 0, at position 1 (rows that accepted draft 0), at the bonus."""
    num_accepted = (out != PLACEHOLDER_TOKEN_ID).sum(dim=1) - 1
    return out[:, 0], out[num_accepted >= 1, 1], out[num_accepted == NUM_SPEC, NUM_SPEC]


@pytest.mark.parametrize("name", list(PAIRS))
def test_emitted_tokens_are_distributed_as_the_target(name: str) -> None:
    p, q = PAIRS[name]
    p_bonus = p.roll(3)  # a different bonus distribution: a mixed-up row would show
    out, _ = run_trials(p, q, p_bonus, RejectionSampler(), one_hot_draft=3)
    first, second, bonus = emitted_by_position(out)
    check_fits(first, p)
    for tokens, expected in [(second, p), (bonus, p_bonus)]:
        if tokens.numel() >= 1000:  # enough for >= 5 expected per cell here
            check_fits(tokens, expected)
    if name == "disjoint":
        assert second.numel() == 0
    else:
        assert bonus.numel() >= 1000


def test_verification_applies_the_requests_filters() -> None:
    logits_p = random_dist(21).log()
    q = random_dist(22)
    out, _ = run_trials(logits_p.exp(), q, logits_p.exp(), RejectionSampler(),
                        temperature=0.7, top_k=5)
    # Independent reference: softmax(log p / T) restricted to the 5 likeliest tokens.
    scaled = torch.softmax(logits_p / 0.7, dim=-1)
    expected = torch.zeros(VOCAB).scatter(0, scaled.topk(5).indices, scaled.topk(5).values)
    first, second, bonus = emitted_by_position(out)
    for tokens in (first, second, bonus):
        check_fits(tokens, expected / expected.sum())


def test_recovered_tokens_come_from_the_residual() -> None:
    num_reqs = TRIALS // 4
    layout = DraftLayout.build([1] * num_reqs, "cpu")
    p = PAIRS["random"][0]
    target_probs = p.expand(2 * num_reqs, -1)
    drafts = torch.full((num_reqs,), 3)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        # q == p: the residual is all zero, so the (never emitted) recovered token falls
        # back to p rather than to an arbitrary token.
        same = draw_random(layout, drafts, p.expand(num_reqs, -1), target_probs, {})
        # One-hot q at x: the residual is p with x removed.
        one_hot = draw_random(layout, drafts, None, target_probs, {})
    check_fits(same.recovered_token_ids, p)
    check_fits(one_hot.recovered_token_ids, p.scatter(0, torch.tensor([3]), 0.0) / (1 - p[3]))


class AlwaysAccepts(RejectionSampler):
    """Wrong on purpose: accepts every draft that p does not rule out."""

    def verify(self, layout, draft_token_ids, draft_probs, target_argmax,  # type: ignore[no-untyped-def]
               target_probs, draws, is_greedy, all_random=False):
        draws = replace(draws, uniforms=torch.zeros_like(draws.uniforms))
        return super().verify(layout, draft_token_ids, draft_probs, target_argmax,
                              target_probs, draws, is_greedy, all_random)


class RecoversFromP(RejectionSampler):
    """Wrong on purpose, a classic bug: recovered tokens from p, not from max(p - q, 0)."""

    def verify(self, layout, draft_token_ids, draft_probs, target_argmax,  # type: ignore[no-untyped-def]
               target_probs, draws, is_greedy, all_random=False):
        recovered = exponential_race(target_probs[layout.draft_rows], {})
        draws = replace(draws, recovered_token_ids=recovered)
        return super().verify(layout, draft_token_ids, draft_probs, target_argmax,
                              target_probs, draws, is_greedy, all_random)


@pytest.mark.parametrize("wrong", [AlwaysAccepts, RecoversFromP])
def test_the_distribution_test_rejects_a_wrong_sampler(wrong: type[RejectionSampler]) -> None:
    p, q = PAIRS["random"]
    out, _ = run_trials(p, q, p, wrong())
    first = out[:, 0]
    assert chi2_statistic(first, p) > chi2_critical(VOCAB - 1, 1e-3)


# --- acceptance rate ------------------------------------------------------------------

def acceptance_rate(out: torch.Tensor) -> float:
    num_accepted = (out != PLACEHOLDER_TOKEN_ID).sum(dim=1) - 1
    return float(num_accepted.sum()) / (out.shape[0] * NUM_SPEC)


def test_acceptance_rate_follows_the_overlap_of_p_and_q() -> None:
    same = run_trials(P_FULL, P_FULL, P_FULL, RejectionSampler())[0]
    assert acceptance_rate(same) > 0.999
    p, q = PAIRS["disjoint"]
    assert acceptance_rate(run_trials(p, q, p, RejectionSampler())[0]) == 0.0
    # In general draft 0 is accepted with probability sum(min(p, q)).
    p, q = PAIRS["random"]
    out, drafts = run_trials(p, q, p, RejectionSampler())
    rate0 = float((out[:, 0] == drafts[:, 0]).double().mean())
    overlap = float(torch.minimum(p, q).sum())
    assert abs(rate0 - overlap) < 5 * math.sqrt(overlap * (1 - overlap) / TRIALS)


# --- seeds ----------------------------------------------------------------------------

def seeded_batch(row: int, batch: int, seed: int = 1234, others_seeded: bool = False,
                 draft_probs: bool = True) -> list[int]:
    """The seeded request (3 drafts, random) at `row` among `batch` mixed requests."""
    num_drafts = [(i % 4) if i != row else 3 for i in range(batch)]
    temperatures = [0.0 if i % 3 == 1 and i != row else 0.9 for i in range(batch)]
    num_total = sum(num_drafts)
    gen = torch.Generator().manual_seed(99)  # inputs fixed; the seeded row's are the same
    logits = torch.randn(num_total + batch, VOCAB, generator=gen) * 0.5
    drafts = torch.randint(0, VOCAB, (num_total,), generator=gen)
    probs = torch.softmax(torch.randn(num_total, VOCAB, generator=gen), dim=-1)
    start = sum(num_drafts[:row])
    mine = torch.arange(start + row, start + row + 4)
    logits[mine] = torch.linspace(-1, 1, VOCAB) * torch.arange(1, 5).unsqueeze(1)
    drafts[start:start + 3] = torch.tensor([7, 6, 7])
    probs[start:start + 3] = torch.softmax(torch.linspace(1, -1, VOCAB), dim=-1)
    seeds = {row: seed}
    if others_seeded:
        seeds.update({i: i for i in range(batch) if i != row})
    out = RejectionSampler()(drafts, num_drafts, probs if draft_probs else None, logits,
                             metadata(temperatures, seeds))
    return out[row].tolist()[:4]


@pytest.mark.parametrize("draft_probs", [True, False])
def test_seeded_request_is_independent_of_the_batch(draft_probs: bool) -> None:
    alone = seeded_batch(0, 1, draft_probs=draft_probs)
    for row, batch, others in [(0, 6, False), (4, 6, False), (5, 9, True), (2, 3, True)]:
        torch.manual_seed(row * 31 + batch)  # the global stream differs every time
        assert seeded_batch(row, batch, others_seeded=others, draft_probs=draft_probs) == alone
    outputs = {tuple(seeded_batch(0, 1, seed=s, draft_probs=draft_probs)) for s in range(12)}
    assert len(outputs) > 1  # the seed matters: the result is not forced by the inputs


# --- Triton ---------------------------------------------------------------------------

def random_batch(num_drafts: list[int], vocab: int, seed: int, device: str = "cpu",
                 match: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafts (about `match` of them the target argmax), draft probs, target logits."""
    gen = torch.Generator().manual_seed(seed)
    num_total, num_reqs = sum(num_drafts), len(num_drafts)
    logits = torch.randn(num_total + num_reqs, vocab, generator=gen)
    layout = DraftLayout.build(num_drafts, "cpu")
    drafts = torch.randint(0, vocab, (num_total,), generator=gen)
    hit = torch.rand(num_total, generator=gen) < match
    drafts = torch.where(hit, logits[layout.draft_rows].argmax(-1), drafts)
    draft_probs = torch.softmax(torch.randn(num_total, vocab, generator=gen), dim=-1)
    return drafts.to(device), draft_probs.to(device), logits.to(device)


def triton_sampler() -> RejectionSampler:
    pytest.importorskip("triton")
    from spec_decode.triton_rejection import TritonRejectionSampler

    return TritonRejectionSampler()


# Tiny shapes: the interpreter costs ~1.5 ms per program (one program per request).
TRITON_CASES = {
    "all_greedy": [0.0, 0.0, 0.0, 0.0],
    "all_random": [1.0, 0.7, 1.0, 1.3],
    "mixed": [0.0, 0.9, 0.0, 1.0],
}


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_matches_torch_given_the_same_draws(case: str, one_hot: bool) -> None:
    num_drafts = [2, 0, 3, 1]
    drafts, draft_probs, logits = random_batch(num_drafts, 16, seed=3)
    meta = metadata(TRITON_CASES[case], {2: 5})
    outs = []
    for sampler in (RejectionSampler(), triton_sampler()):
        torch.manual_seed(0)  # both draw through the same torch code, so draw the same
        outs.append(sampler(drafts, num_drafts, None if one_hot else draft_probs, logits, meta))
    assert torch.equal(outs[0], outs[1])


def test_triton_verify_matches_torch_on_explicit_draws_and_ties() -> None:
    num_drafts = [3, 1, 0, 2]
    drafts, _, logits = random_batch(num_drafts, 16, seed=4)
    layout = DraftLayout.build(num_drafts, "cpu")
    probs = torch.softmax(logits, dim=-1)
    p = probs[layout.draft_rows].gather(1, drafts.unsqueeze(1)).squeeze(1)
    # One-hot q: u = p is a tie (rejected by both), u just below p is accepted.
    uniforms = torch.tensor([0.0, 0.999, 0.3, 0.1, 0.0, 0.2])
    uniforms[1] = p[1]
    uniforms[4] = torch.nextafter(p[4], torch.tensor(0.0))
    draws = RandomDraws(uniforms, torch.arange(6) + 9, torch.arange(4) + 1)
    args = (layout, drafts, None, logits.argmax(-1), probs, draws)
    for greedy in ([False] * 4, [True, False, False, True]):
        is_greedy = torch.tensor(greedy)
        want = RejectionSampler().verify(*args, is_greedy, all_random=not any(greedy))
        got = triton_sampler().verify(*args, is_greedy, all_random=not any(greedy))
        assert torch.equal(got, want)
        if not any(greedy):  # the tie rejects (recovered 9 + 1), just below p accepts
            assert want[0, 1] == 10 and want[3, 0] == drafts[4]


def test_factory_picks_torch_on_cpu() -> None:
    from runner.spec import make_rejection_sampler

    assert type(make_rejection_sampler("cpu")) is RejectionSampler


@pytest.mark.gpu
def test_triton_on_cuda_matches_torch() -> None:
    from runner.spec import make_rejection_sampler
    from spec_decode.triton_rejection import TritonRejectionSampler

    assert isinstance(make_rejection_sampler("cuda"), TritonRejectionSampler)
    gen = torch.Generator().manual_seed(0)
    num_drafts = torch.randint(0, 8, (64,), generator=gen).tolist()
    drafts, draft_probs, logits = random_batch(num_drafts, 49152, seed=1, device="cuda")
    temperatures = [0.0 if i % 3 == 0 else 0.8 for i in range(64)]
    meta = metadata(temperatures, device="cuda", top_p=0.9)
    layout = DraftLayout.build(num_drafts, "cuda")
    from spec_decode.rejection_sampler import compute_target_probs

    for q in (draft_probs, None):
        probs = compute_target_probs(logits, meta, layout.req_of_row)
        draws = draw_random(layout, drafts, q, probs, {})
        is_greedy = meta.temperature < 1e-5
        args = (layout, drafts, q, logits.argmax(-1), probs, draws, is_greedy)
        assert torch.equal(TritonRejectionSampler().verify(*args), RejectionSampler().verify(*args))
        out = TritonRejectionSampler()(drafts, num_drafts, q, logits, meta)
        assert out.shape == (64, max(num_drafts) + 1) and out.is_cuda


def test_seeded_one_hot_verification_emits_what_the_sampler_would() -> None:
    """With greedy (one-hot) drafts, a seeded request's emitted tokens are the tokens
    the plain sampler draws at the same (seed, position), whatever was drafted: so a
    seeded request gives the same text under every method and with speculation off."""
    from runner.sampler import Sampler

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(5, VOCAB, generator=gen) * 0.3  # 4 verify rows + the bonus row
    position = 40
    want = []
    for j in range(5):
        meta = sampling_metadata(
            [SamplingParams(temperature=1.0)], {0: 77}, positions=np.array([position + j]))
        want.append(int(Sampler()(logits[j:j + 1], meta).sampled_token_ids[0]))
    for drafts in ([want[0], want[1], want[2], want[3]], [want[0], 0, 0, 0],
                   [(want[0] + 1) % VOCAB] * 4, [want[0], want[1], (want[2] + 1) % VOCAB, 1]):
        meta = sampling_metadata(
            [SamplingParams(temperature=1.0)], {0: 77}, positions=np.array([position]))
        out = RejectionSampler()(torch.tensor(drafts), [4], None, logits, meta)[0].tolist()
        emitted = [t for t in out if t >= 0]
        assert emitted == want[:len(emitted)], (drafts, emitted, want)
        accepted = next((i for i, (d, w) in enumerate(zip(drafts, want)) if d != w), 4)
        assert len(emitted) == accepted + 1
