"""Sampler: greedy, filters, seeds independent of the batch, distribution, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from runner.sampler import Sampler, SamplerOutput
from scheduler.request import SamplingParams
from spec_decode.sampling import (
    apply_min_p,
    apply_top_k_top_p,
    greedy_ids,
    position_seed,
    top_with_confidence,
)
from tests.sampling_helpers import chi2_critical, chi2_statistic, sampling_metadata

VOCAB = 64


def sample(logits: torch.Tensor, params: list[SamplingParams],
           seeds: dict[int, int] | None = None, position: int = 0) -> SamplerOutput:
    positions = np.full(len(params), position, dtype=np.int64)
    meta = sampling_metadata(params, seeds, positions=positions)
    return Sampler()(logits, meta)


def flat_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 0.5) -> torch.Tensor:
    """Random logits close to uniform, so filters cut off tokens that would often win."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def repeated_draws(row: torch.Tensor, params: SamplingParams, draws: int,
                   seed: int = 0) -> torch.Tensor:
    """`draws` samples from one row's distribution: the row repeated, one shared stream."""
    logits = row.unsqueeze(0).expand(draws, -1).contiguous()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return sample(logits, [params] * draws).sampled_token_ids


# --- greedy ---------------------------------------------------------------------------

def test_greedy_equals_argmax() -> None:
    logits = flat_logits(8, scale=3.0)
    out = sample(logits, [SamplingParams()] * 8)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 128])
def test_greedy_ids_break_ties_at_the_first_maximum_as_argmax_does(
        dtype: torch.dtype, rows: int) -> None:
    """Greedy decoding is lossless only if every path picks the same token among equal
    logits: coarse integer logits tie often, and a row of NaN or of one value repeated
    puts the tie everywhere."""
    gen = torch.Generator().manual_seed(rows)
    logits = torch.randint(-2, 3, (rows, 49_152), generator=gen).to(dtype)
    logits[0, 17::1000] = 9.0  # the maximum at many places, the first at 17
    if rows > 1:
        logits[1] = 4.0
    if rows > 2:
        logits[2] = float("nan")
    ids = greedy_ids(logits)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, logits.argmax(dim=-1))
    assert int(ids[0]) == 17


@pytest.mark.parametrize("top_k", [2, 4, 8])
def test_a_tree_s_candidates_start_with_the_greedy_pick_and_repeat_none(top_k: int) -> None:
    """Drafted trees list the greedy draft, then the next candidates: among tied
    logits topk orders ids as it likes, and none may be listed twice (a wasted row)."""
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randint(-2, 3, (64, 8192), generator=gen).float()
    logits[0, 100::500] = 9.0  # more maxima than candidates
    logits[1, [3, 40, 900]] = 9.0  # fewer
    ids, _ = top_with_confidence(logits, top_k)
    assert torch.equal(ids[:, 0], greedy_ids(logits))
    assert all(len(set(row)) == top_k for row in ids.tolist())
    values = logits.gather(1, ids)
    assert torch.equal(values[:, 1:].max(dim=-1).values <= values[:, 0],
                       torch.ones(64, dtype=torch.bool))
    assert torch.equal(values.sort(dim=-1, descending=True).values,
                       torch.topk(logits, top_k, dim=-1).values)


def test_a_greedy_pick_that_takes_the_last_maximum_is_caught() -> None:
    """The check above is real: the last of the equal maxima differs from argmax."""
    logits = torch.zeros(1, 8)
    logits[0, [2, 5]] = 1.0
    last = logits.shape[1] - 1 - logits.flip(-1).argmax(dim=-1)
    assert not torch.equal(last, greedy_ids(logits))


def test_mixed_batch_greedy_rows_are_argmax_and_random_rows_vary() -> None:
    logits = flat_logits(6, scale=0.1)  # nearly flat: random rows rarely hit the argmax
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, top_k=i % 3 * 10)
              for i in range(6)]
    greedy_rows = torch.tensor([0, 2, 4])
    seen_random = set()
    for step in range(20):
        with torch.random.fork_rng():
            torch.manual_seed(step)
            tokens = sample(logits, params).sampled_token_ids
        assert torch.equal(tokens[greedy_rows], logits[greedy_rows].argmax(dim=-1))
        seen_random.add(int(tokens[1]))
    assert len(seen_random) > 5


def test_temperature_to_zero_approaches_greedy() -> None:
    logits = flat_logits(16, scale=2.0)
    greedy = sample(logits, [SamplingParams()] * 16).sampled_token_ids
    cold = sample(logits, [SamplingParams(temperature=1e-3)] * 16).sampled_token_ids
    assert torch.equal(cold, greedy)
    # Below the sampling epsilon a temperature is greedy outright, never a division.
    meta = sampling_metadata([SamplingParams(temperature=1e-7)])
    assert meta.all_greedy and float(meta.temperature[0]) == 0.0


def test_input_logits_are_not_modified() -> None:
    logits = flat_logits(4)
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=0.7, top_k=5, top_p=0.5, min_p=0.1,
                                   logprobs=2)] * 4)
    assert torch.equal(logits, before)


# --- seeds ----------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=1234)


def seeded_run(row: int, batch: int, others_seeded: bool, seed: int = 1234,
               steps: int = 20) -> list[int]:
    """The seeded request's tokens over `steps` steps, at `row` of a batch of `batch`."""
    seeds = {row: seed}
    other_params = []
    for i in range(batch):
        if i == row:
            continue
        other_params.append(SamplingParams(temperature=0.5 + 0.2 * i, top_p=0.8, min_p=0.05))
        if others_seeded:
            seeds[i] = seed + 100 + i
    tokens = []
    for step in range(steps):
        own = flat_logits(1, seed=10_000 + step)  # this request's logits at this step
        noise = flat_logits(batch, seed=step + 7 * batch + row)  # the others', batch-dependent
        logits = torch.cat([noise[:row], own, noise[row + 1:]])
        params = [*other_params[:row], SEEDED, *other_params[row:]]
        tokens.append(int(sample(logits, params, seeds, position=step).sampled_token_ids[row]))
    return tokens


def test_seeded_request_is_independent_of_batch_composition_and_row() -> None:
    alone = seeded_run(row=0, batch=1, others_seeded=False)
    assert len(set(alone)) > 5  # the sequence really is random, not stuck
    assert seeded_run(row=0, batch=6, others_seeded=False) == alone
    assert seeded_run(row=3, batch=6, others_seeded=False) == alone
    assert seeded_run(row=3, batch=6, others_seeded=True) == alone
    assert seeded_run(row=5, batch=6, others_seeded=True) == alone


def test_different_seeds_differ() -> None:
    assert seeded_run(0, 1, False, seed=1) != seeded_run(0, 1, False, seed=2)


def test_every_bit_of_the_seed_counts() -> None:
    """Seeds that differ only above bit 31 (the CPU generator keeps 32 bits of its own
    seed) or only in sign still give different streams."""
    assert seeded_run(0, 1, False, seed=5) != seeded_run(0, 1, False, seed=5 + (1 << 32))
    assert seeded_run(0, 1, False, seed=5) != seeded_run(0, 1, False, seed=5 - (1 << 63))
    keys = {position_seed(seed, pos) & 0xFFFFFFFF for seed in (5, 5 + (1 << 32), 5 + (1 << 62))
            for pos in range(100)}
    assert len(keys) == 300


def test_draws_are_keyed_by_position_not_by_how_many_were_drawn() -> None:
    """The token at position p depends on (seed, p) alone: drawing others first (as a
    step verifying more drafts does) changes nothing."""
    logits = flat_logits(1, seed=3)
    params = [SamplingParams(temperature=1.0, seed=9)]
    first = [int(sample(logits, params, {0: 9}, position=p).sampled_token_ids[0])
             for p in range(30)]
    again = [int(sample(logits, params, {0: 9}, position=p).sampled_token_ids[0])
             for p in reversed(range(30))][::-1]
    assert first == again and len(set(first)) > 5


# --- filters --------------------------------------------------------------------------

def nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """Smallest set of most likely tokens with mass >= p, in float64."""
    order = torch.argsort(probs.double(), descending=True)
    cumulative = torch.cumsum(probs.double()[order], dim=0)
    size = int((cumulative < p).sum()) + 1
    return set(order[:size].tolist())


def safe_top_p(probs: torch.Tensor, size: int) -> float:
    """A p halfway between two cumulative masses: a nucleus of `size`, far from rounding."""
    cumulative = torch.cumsum(probs.double().sort(descending=True).values, dim=0)
    return float(cumulative[size - 2] + cumulative[size - 1]) / 2


def test_top_k_never_leaves_the_top_k() -> None:
    row = flat_logits(1, scale=0.3)[0]
    tokens = repeated_draws(row, SamplingParams(temperature=1.0, top_k=7), draws=2000)
    allowed = set(row.topk(7).indices.tolist())
    assert set(tokens.tolist()) == allowed  # never outside, and flat enough to hit all 7


def test_top_p_never_leaves_the_nucleus() -> None:
    row = flat_logits(1, scale=0.8, seed=3)[0]
    temperature = 0.9
    probs = torch.softmax(row / temperature, dim=-1)
    p = safe_top_p(probs, size=12)
    allowed = nucleus(probs, p)
    assert len(allowed) == 12
    tokens = repeated_draws(row, SamplingParams(temperature=temperature, top_p=p), draws=2000)
    assert set(tokens.tolist()) <= allowed
    assert len(set(tokens.tolist())) >= 10


def test_min_p_never_emits_below_threshold() -> None:
    row = flat_logits(1, scale=1.0, seed=4)[0]
    probs = torch.softmax(row, dim=-1)
    ratios = (probs / probs.max()).sort(descending=True).values
    min_p = float(ratios[9] + ratios[10]) / 2  # keeps exactly 10, far from the boundary
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    assert len(allowed) == 10
    tokens = repeated_draws(row, SamplingParams(temperature=1.0, min_p=min_p), draws=2000)
    assert set(tokens.tolist()) <= allowed


def test_combined_filters_match_an_independent_reference() -> None:
    row = flat_logits(1, scale=1.0, seed=5)[0]
    temperature, top_k = 0.8, 20
    scaled = row / temperature
    top = scaled.topk(top_k)
    topk_probs = torch.softmax(top.values, dim=-1)  # renormalised over the top k
    top_p = safe_top_p(topk_probs, size=12)
    kept = [int(top.indices[i]) for i in sorted(nucleus(topk_probs, top_p))]
    kept_logits = scaled[kept]
    ratios = torch.softmax(kept_logits, dim=-1)
    ratios = (ratios / ratios.max()).sort(descending=True).values
    min_p = float(ratios[7] + ratios[8]) / 2  # cuts the nucleus of 12 down to 8
    allowed = {t for t in kept if float(scaled[t]) >= float(scaled.max()) + math.log(min_p)}
    assert len(allowed) == 8
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = repeated_draws(row, params, draws=4000)
    assert set(tokens.tolist()) <= allowed
    # Within the set, tokens follow the renormalised distribution.
    probs = torch.zeros_like(row)
    ids = torch.tensor(sorted(allowed))
    probs[ids] = torch.softmax(scaled[ids], dim=-1)
    assert chi2_statistic(tokens, probs) < chi2_critical(df=len(ids) - 1, alpha=1e-3)


def test_top_p_keeps_the_top_token_even_when_it_alone_exceeds_p() -> None:
    logits = torch.tensor([[5.0, 0.0, -1.0, -2.0]] * 2)
    # Row 1: p = 0 cannot come from SamplingParams, but a tensor-level caller may pass it.
    masked = apply_top_k_top_p(logits, torch.tensor([0, 0]), torch.tensor([0.01, 0.0]))
    assert torch.isfinite(masked).tolist() == [[True, False, False, False]] * 2


def test_off_values_mask_nothing_even_on_a_peaked_row() -> None:
    # fp32 softmax of this row rounds the top token to 1.0, so a naive cumsum would
    # reach p = 1.0 before the tail; k = 0 and k > V must not cut the lowest token.
    logits = torch.tensor([[30.0] + [-float(i) for i in range(VOCAB - 1)]] * 2)
    masked = apply_top_k_top_p(logits, torch.tensor([0, VOCAB + 5]), torch.tensor([1.0, 1.0]))
    assert torch.equal(masked, logits)
    assert torch.equal(apply_min_p(logits, torch.tensor([0.0, 0.0])), logits)


def test_edge_values_are_no_ops() -> None:
    logits = flat_logits(5, scale=1.0, seed=6)
    plain = SamplingParams(temperature=0.9)
    edge = SamplingParams(temperature=0.9, top_k=VOCAB + 100, top_p=1.0, min_p=0.0)
    active = SamplingParams(temperature=0.9, top_k=3, top_p=0.5, min_p=0.2)
    for step in range(20):
        gens_a = {i: step * 10 + i for i in range(4)}
        gens_b = {i: step * 10 + i for i in range(4)}
        # Row 4 forces the filter path on for the whole batch; rows 0-3 must not notice.
        want = sample(logits, [plain] * 4 + [plain], gens_a).sampled_token_ids[:4]
        got = sample(logits, [edge] * 4 + [active], gens_b).sampled_token_ids[:4]
        assert torch.equal(got, want)
    meta = sampling_metadata([edge])
    assert meta.no_top_k is False and meta.no_top_p and meta.no_min_p


# --- distribution ---------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_temperature_sampling_matches_softmax(temperature: float) -> None:
    row = flat_logits(1, vocab=12, seed=8, scale=1.0)[0]
    draws = 20_000
    tokens = repeated_draws(row, SamplingParams(temperature=temperature), draws, seed=42)
    critical = chi2_critical(df=row.numel() - 1, alpha=1e-3)
    assert chi2_statistic(tokens, torch.softmax(row / temperature, dim=-1)) < critical
    # The test has power: the distribution at the wrong temperature is rejected.
    wrong = torch.softmax(row / (temperature * 1.3), dim=-1)
    assert chi2_statistic(tokens, wrong) > critical


def test_wilson_hilferty_matches_known_quantiles() -> None:
    # Tabulated chi-square upper quantiles (df, alpha, value). From df ≈ 5 on (every df
    # used here) the approximation is within 1 %, a touch high far in the tail: conservative.
    for df, alpha, value in [(5, 0.05, 11.070), (11, 1e-3, 31.264), (63, 0.01, 92.010)]:
        assert chi2_critical(df, alpha) == pytest.approx(value, rel=0.01)


# --- logprobs -------------------------------------------------------------------------

@pytest.mark.parametrize("num_logprobs", [0, 1, 5])
def test_logprobs_shapes_and_values(num_logprobs: int) -> None:
    logits = flat_logits(6, scale=2.0, seed=9)
    params = [SamplingParams(temperature=0.0 if i < 2 else 0.7, top_k=10,
                             logprobs=num_logprobs if i % 2 else None) for i in range(6)]
    out = sample(logits, params)
    assert out.logprobs is not None
    n = num_logprobs
    assert out.logprobs.token_ids.shape == (6, n + 1)
    assert out.logprobs.token_ids.dtype == torch.int64
    assert out.logprobs.logprobs.shape == (6, n + 1)
    assert out.logprobs.selected_token_ranks.shape == (6,)
    # Raw logits: before temperature and top-k, whatever the row's sampling params.
    reference = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprobs.token_ids[:, 0], sampled)
    assert torch.allclose(out.logprobs.logprobs[:, 0], reference.gather(1, sampled[:, None])[:, 0])
    top = reference.topk(n, dim=-1)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs.logprobs[:, 1:], top.values)
    assert bool((out.logprobs.logprobs[:, 1:].diff(dim=-1) <= 0).all())
    ranks = (reference > reference.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(out.logprobs.selected_token_ranks, ranks)
    assert out.logprobs.selected_token_ranks[:2].tolist() == [1, 1]  # greedy rows


def test_logprobs_on_all_greedy_batch() -> None:
    logits = flat_logits(3, scale=2.0)
    out = sample(logits, [SamplingParams(logprobs=2)] * 3)
    assert out.logprobs is not None
    assert torch.equal(out.logprobs.token_ids[:, 0], out.logprobs.token_ids[:, 1])
