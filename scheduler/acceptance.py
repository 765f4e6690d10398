"""The goodput policy's acceptance estimates, and the check on its forecasts.

`AcceptanceEstimates`: per draft position i, how often a draft that is reached (all
drafts before it accepted) is accepted, kept per state the request's last verification
had left when the draft's k was chosen (all accepted, some, none, no verification yet:
drafts come in runs) and per span of the answer it is in (a lookup drafter copies more
as the answer grows), counted with decay so the estimate follows a changing workload;
each request's own record scales it. `ForecastCheck`: how many of the drafts the policy
chose were accepted against how many it forecast, which scales its next forecasts.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from typing import NamedTuple

import numpy as np

from scheduler.config import GoodputSettings, by_position
from scheduler.request import FRESH, NUM_OUTCOMES
from scheduler.request_spread import RequestSpread, prior_weight

# Where an answer's spans start, in output tokens: acceptance changes along an answer
# (a lookup drafter has more of the answer's own text to copy as it grows: ngram's
# first draft after a rejection, measured on held-out chat at 4 running, is accepted
# 0.06 of the time in the first 16 tokens, 0.16 up to 32 and 0.48 after), so the
# estimates are kept per span as well as per state.
SPAN_STARTS = (16, 32, 64, 128, 256)
NUM_SPANS = len(SPAN_STARTS) + 1
# Pseudo-verifications at the method's mix of states behind a request's own
# (`AcceptanceEstimates.state_mix`): a few, as a request's own record is (its first
# verifications say little of how its drafts come in runs).
STATE_MIX_PRIOR = 4.0
# Up to this many verifications a step, `AcceptanceEstimates.record` adds them one by one:
# cheaper than its histograms' dozen numpy calls (one request verifies every step).
_FEW = 4


def span_of(num_output: np.ndarray | list[int]) -> np.ndarray:
    """The span of an answer each output length falls in (0: before the first start)."""
    return np.searchsorted(SPAN_STARTS, num_output, side="right")


def reaching_by_state(counts: np.ndarray, states: np.ndarray, width: int,
                      num_groups: int = NUM_OUTCOMES) -> np.ndarray:
    """[num_groups, width]: per state (or any group index), how many of `counts` (those
    of that group) exceed i, for i < width (`stats.reaching`, one histogram per group)."""
    span = width + 1
    hist = np.bincount(states * span + np.minimum(counts, width),
                       minlength=num_groups * span).reshape(num_groups, span)
    return np.cumsum(hist[:, ::-1], axis=1)[:, ::-1][:, 1:]


def _shrunk(accepted: np.ndarray, reached: np.ndarray, toward: np.ndarray,
            weight: float) -> np.ndarray:
    """Observed rates with `weight` pseudo-observations at `toward`."""
    return (accepted + weight * toward) / (reached + weight)


class _Tables(NamedTuple):
    """`AcceptanceEstimates.tables()`: rates [K] pooled, [NUM_OUTCOMES, K] per state,
    [NUM_SPANS, K] per span, [NUM_OUTCOMES, NUM_SPANS, K] per cell, and the decayed
    count of first drafts reached they were built on."""

    pooled: np.ndarray
    by_state: np.ndarray
    by_span: np.ndarray
    cells: np.ndarray
    seen: float


class AcceptanceEstimates:
    """Acceptance of a reached draft, per draft position, per state of the request's
    last verification and per span of the answer it is in, and per request.

    Pooled rates are shrunk toward the prior; each state's and each span's toward the
    pooled ones; each (state, span) cell toward the product of its state's and its
    span's effects (state rate x span rate / pooled rate), so a cell seen rarely is
    rated by what its row and its column say."""

    def __init__(self, max_k: int, settings: GoodputSettings,
                 drafter_kind: str | None = None) -> None:
        self.settings = settings
        self.prior = np.asarray(settings.prior_by_position(max_k))  # [K]
        # Decayed counts per state, span and draft position.
        self.accepted = np.zeros((NUM_OUTCOMES, NUM_SPANS, max_k))
        self.reached = np.zeros((NUM_OUTCOMES, NUM_SPANS, max_k))
        # `tables()` as last built, and the verifications recorded since.
        self._tables: _Tables | None = None
        self._since = 0
        # How far finished requests' own first-draft acceptance spread: how much a
        # running request's own record counts.
        self.spread = RequestSpread(prior_weight(settings.request_weight, drafter_kind),
                                    settings.spread_min_requests, settings.spread_decay,
                                    settings.max_request_weight)

    def record(self, verified: list[int], accepted: list[int],
               states: list[int] | None = None, produced: list[int] | None = None) -> None:
        """One step's verifications (drafts verified, accepted), each verified >= 1, the
        state each request was in before it (FRESH if not given) and its output tokens
        then (0 if not given). Position i was reached if i <= accepted (and i < verified)."""
        if not verified:
            return
        self._since += len(verified)
        fade = self.settings.decay ** len(verified)
        self.accepted *= fade
        self.reached *= fade
        if len(verified) <= _FEW:  # a few requests: slices, not histograms
            for i, (v1, a1) in enumerate(zip(verified, accepted, strict=True)):
                state = states[i] if states is not None else 0
                span = bisect_right(SPAN_STARTS, produced[i]) if produced is not None else 0
                self.reached[state, span, :min(a1 + 1, v1)] += 1.0
                self.accepted[state, span, :a1] += 1.0
            return
        v, a = np.asarray(verified), np.asarray(accepted)
        s = np.asarray(states) if states is not None else np.zeros(len(v), dtype=np.int64)
        group = s * NUM_SPANS + (span_of(produced) if produced is not None else 0)
        shape = self.reached.shape
        cells, width = NUM_OUTCOMES * NUM_SPANS, shape[2]
        self.reached += reaching_by_state(np.minimum(a + 1, v), group, width,
                                          cells).reshape(shape)
        self.accepted += reaching_by_state(a, group, width, cells).reshape(shape)

    def record_finished(self, verifications: list[int], first_accepted: int) -> None:
        """A request that finished (or was aborted): its verifications per state it was
        in, and how many accepted their first draft, against what its states forecast."""
        total = sum(verifications)
        if total and self.reached.shape[2]:
            forecast = float(np.dot(verifications, self.tables().by_state[:, 0]))
            self.spread.record(total, first_accepted, forecast)

    def state_mix(self, verifications: np.ndarray) -> np.ndarray:
        """[N, NUM_OUTCOMES] the share of its drafting steps each request spends in each
        state of its last verification, in the long run: its own verifications per
        state past its first (FRESH comes once), and the method's mix (the first drafts
        reached per state) as `STATE_MIX_PRIOR` more, so a request with no history is
        rated as the method's are."""
        method = self.reached[:, :, 0].sum(axis=1)
        method[FRESH] = 0.0
        total = float(method.sum())
        mix = method / total if total > 0 else np.full(NUM_OUTCOMES, 1.0 / (NUM_OUTCOMES - 1))
        mix[FRESH] = 0.0
        own = np.asarray(verifications, dtype=float).copy()
        own[:, FRESH] = 0.0
        weights = own + STATE_MIX_PRIOR * mix
        return weights / weights.sum(axis=1, keepdims=True)

    def pooled_rates(self) -> np.ndarray:
        """[K] acceptance of a reached draft at each position, all states and spans
        together, smoothed by the prior."""
        s = self.settings
        return _shrunk(self.accepted.sum(axis=(0, 1)), self.reached.sum(axis=(0, 1)),
                       self.prior, s.prior_weight)

    def position_rates(self, pooled: np.ndarray | None = None) -> np.ndarray:
        """[NUM_OUTCOMES, K] per state of the last verification, all spans together,
        shrunk toward the pooled rates (a state seen rarely says little; `pooled`:
        `pooled_rates()` if known)."""
        pooled = self.pooled_rates() if pooled is None else pooled
        return _shrunk(self.accepted.sum(axis=1), self.reached.sum(axis=1), pooled,
                       self.settings.prior_weight)

    def span_rates(self, pooled: np.ndarray | None = None) -> np.ndarray:
        """[NUM_SPANS, K] per span of the answer, all states together, shrunk toward
        the pooled rates."""
        pooled = self.pooled_rates() if pooled is None else pooled
        return _shrunk(self.accepted.sum(axis=0), self.reached.sum(axis=0), pooled,
                       self.settings.prior_weight)

    def cell_rates(self, pooled: np.ndarray, by_state: np.ndarray,
                   by_span: np.ndarray) -> np.ndarray:
        """[NUM_OUTCOMES, NUM_SPANS, K] per state and span, from the pooled, per-state
        and per-span rates."""
        both = np.clip(by_state[:, None, :] * by_span[None, :, :] / np.maximum(pooled, 1e-6),
                       0.0, 0.99)
        return _shrunk(self.accepted, self.reached, both, self.settings.prior_weight)

    def tables(self) -> _Tables:
        """The pooled, per-state, per-span and per-cell rates and the first drafts
        reached, rebuilt once the verifications recorded since the last build exceed
        `stale_share` of those it counted (every verification while few are counted):
        rebuilding them is a third of a decision's work (~90 us in place at 4 running),
        and with a thousand verifications counted, 16 more move a rate by ~1 %."""
        tables = self._tables
        if tables is None or self._since > self.settings.stale_share * tables.seen:
            pooled = self.pooled_rates()
            by_state, by_span = self.position_rates(pooled), self.span_rates(pooled)
            tables = _Tables(pooled, by_state, by_span,
                             self.cell_rates(pooled, by_state, by_span),
                             float(self.reached[..., 0].sum()))
            self._tables, self._since = tables, 0
        return tables

    def request_rates(self, verifications: np.ndarray, first_accepted: np.ndarray,
                      states: np.ndarray, explore: bool = True,
                      unverified: np.ndarray | None = None,
                      produced: np.ndarray | None = None) -> np.ndarray:
        """[N, K] per request, clipped to [0, 0.99]: `rates_and_optimism`, with the
        optimism added if `explore`."""
        own, bonus = self.rates_and_optimism(verifications, first_accepted, states,
                                             unverified, produced)
        return np.clip(own + explore * bonus[:, None], 0.0, 0.99)

    def rates_and_optimism(self, verifications: np.ndarray, first_accepted: np.ndarray,
                           states: np.ndarray, unverified: np.ndarray | None = None,
                           produced: np.ndarray | None = None,
                           ) -> tuple[np.ndarray, np.ndarray]:
        """[N, K] per request (unclipped), and [N] the optimism its little history
        earns: the rates of the state its last verification left and of
        the span it is in (`produced`: its output tokens; 0 if None), scaled by its
        first-draft acceptances over what its states predicted (`verifications`
        [N, NUM_OUTCOMES]: its verifications per state it was in; every verification
        reaches the first draft, so the ratio is fair), shrunk toward 1 by as many
        pseudo-verifications as finished requests' spread is worth (`spread.weight`).

        A request's record and state fade, by half per `evidence_half_life` output
        tokens it made since its last verification (`unverified`; none if None), to
        its span's rates: a request that drafts nothing is never verified, so without
        this an early run of rejections parks it for good (measured: ngram at 4
        running, 315 of 403 request-steps parked in state "none accepted", while its
        drafts past the 32nd token are accepted 0.6-0.75 of the time)."""
        s = self.settings
        pooled, by_state, by_span, cells, seen = self.tables()
        spans = span_of(produced) if produced is not None else np.zeros(len(states), dtype=int)
        own = cells[states, spans]
        if unverified is not None:
            weight = (0.5 ** (np.asarray(unverified, dtype=float) / s.evidence_half_life))
            verifications = verifications * weight[:, None]
            first_accepted = first_accepted * weight
            own = own * weight[:, None] + by_span[spans] * (1.0 - weight[:, None])
        scale = self._record_scale(verifications, first_accepted, pooled, by_state)
        # Optimism shrinks with the request's own history and with the method's: once
        # the batch has verified hundreds of drafts, a fresh request is most likely
        # like them, and exploring it costs verification rows (and maybe a drafter
        # pass) that a batch of 64 pays on every request it tries.
        method_doubt = np.sqrt(s.prior_weight / (s.prior_weight + s.prior_evidence + seen))
        bonus = s.explore * method_doubt / (1.0 + verifications.sum(axis=1))
        return own * np.reshape(scale, (-1, 1)), bonus

    def rates_by_state(self, verifications: np.ndarray, first_accepted: np.ndarray,
                       produced: np.ndarray | None = None) -> np.ndarray:
        """[N, NUM_OUTCOMES, K] each request's rates (unclipped) in every state its
        next verification may leave, its record as it stands (nothing unverified):
        `rates_and_optimism` for each state, in one lookup."""
        pooled, by_state, _, cells, _ = self.tables()
        spans = (span_of(produced) if produced is not None
                 else np.zeros(len(verifications), dtype=int))
        scale = self._record_scale(verifications, first_accepted, pooled, by_state)
        return cells[:, spans].transpose(1, 0, 2) * np.reshape(scale, (-1, 1, 1))

    def _record_scale(self, verifications: np.ndarray, first_accepted: np.ndarray,
                      pooled: np.ndarray, by_state: np.ndarray) -> np.ndarray | float:
        """Each request's first-draft acceptances over what its states predicted, shrunk
        toward 1 by `spread.weight` pseudo-verifications (`rates_and_optimism`)."""
        first = float(pooled[0]) if len(pooled) else 0.0
        if first <= 0:
            return 1.0
        pseudo = self.spread.weight * first
        expected = verifications @ by_state[:, 0]
        return (first_accepted + pseudo) / (expected + pseudo)


class ForecastCheck:
    """How many drafts the policy's chosen drafts got accepted, against how many it
    forecast for them. The drafts it chooses are the ones its estimates rate highest,
    so the estimates' errors are not even there: a request rated high on three
    verifications, or on the optimism a fresh one gets, is chosen for exactly that
    (measured: at 64 running, dflash's chosen drafts were forecast 0.5-0.7 and got
    0.19). The ratio, counted with decay, scales the next forecasts.

    Drafts chosen when a step is planned are verified in the next step, so a forecast
    waits one step for its outcome; per draft, since the rule or the budget may cut a
    cap and a request may finish before it verifies."""

    def __init__(self, settings: GoodputSettings) -> None:
        self.decay = settings.decay
        self.forecast = settings.forecast_weight  # decayed, per verified draft
        self.accepted = settings.forecast_weight
        self.pending: deque[float] = deque(maxlen=2)  # forecast per draft, by step

    @property
    def factor(self) -> float:
        return self.accepted / self.forecast

    def expect(self, forecast: float, drafts: int) -> None:
        """A step was planned with `drafts` drafts allowed, forecast to get `forecast`
        accepted."""
        self.pending.append(forecast / drafts if drafts else 0.0)

    def settle(self, accepted: int, verified: int) -> None:
        """The step just run verified the drafts the step before it allowed."""
        if len(self.pending) < 2:
            return
        per_draft = self.pending.popleft()
        if not verified or per_draft <= 0.0:
            return
        fade = self.decay ** verified
        self.forecast = self.forecast * fade + per_draft * verified
        self.accepted = self.accepted * fade + accepted


class ProposalRates:
    """How often a request allowed j drafts proposed at least j, per position j: a
    lookup drafter proposes only what its tables match (held-out chat at 16 running,
    K = 4: suffix proposed none in 49 % of the request-steps that allowed drafts, ngram
    in 63 %; a model drafter always proposes what it is allowed). The acceptance rates
    are per draft proposed, so a request's expected accepted drafts per step at k are
    these rates times the acceptance gains. Counted with the estimates' decay, behind
    one allowed draft proposed per position, so with nothing seen (or a model drafter
    without a confidence gate) the rates are exactly 1; or behind `weight` observations
    at a measured `prior` (a gated chain drafter's; the last repeated): a position the
    policy rarely allows is then priced at what was measured, not at 1."""

    def __init__(self, max_k: int, decay: float, prior: tuple[float, ...] = (),
                 weight: float = 1.0) -> None:
        self.decay = decay
        self.allowed = np.full(max_k, weight if prior else 1.0)
        rates = np.array(by_position(prior, max_k)) if prior else np.ones(max_k)
        self.proposed = self.allowed * rates

    @property
    def rates(self) -> np.ndarray:
        """[K] the chance a request allowed j + 1 drafts proposes at least j + 1."""
        return self.proposed / self.allowed

    def record(self, allowed: list[int], proposed: list[int]) -> None:
        """One step's requests that were allowed drafts: how many each was allowed and
        how many it proposed."""
        if not allowed:
            return
        fade = self.decay ** len(allowed)
        positions = np.arange(len(self.allowed))[None, :]
        k = np.asarray(allowed)[:, None]
        got = np.minimum(np.asarray(proposed), k[:, 0])[:, None]
        self.allowed = self.allowed * fade + (positions < k).sum(axis=0)
        self.proposed = self.proposed * fade + (positions < got).sum(axis=0)
