"""`draft_policy="goodput"`: each step, the k each sampling request proposes is the one
that maximises the step's expected output tokens per second.

Two online estimates, both owned here and both injectable (tests seed them):

- `AcceptanceEstimates`: per draft position i, how often a draft that is reached (all
  drafts before it accepted) is accepted, kept per state the request's last
  verification left (all accepted, some, none, no verification yet: drafts come in
  runs, so that state predicts best) and per span of the answer it is in (a lookup
  drafter copies more as the answer grows), counted with decay so the estimate follows
  a changing workload. Each request's own record scales it (its first-draft
  acceptances over what its states predicted: a request that keeps rejecting stops
  drafting, one that accepts everything drafts the most); that record and its state
  fade while it goes unverified, so a request parked early is rated by its span again
  later. A request with little history gets a little optimism, so the estimates keep
  learning, less as the method's own record grows.
- `StepTimeModel` (scheduler/step_cost.py): the seconds of a step from its rows in
  each pass, fitted online from the step times the runner reports.

`GoodputPolicy.caps` turns them into a cap on k per running request: in steady state a
request proposing k drafts puts 1 + k rows in the target pass and the method's rows in
each drafter pass, and gains 1 + E[accepted | k] tokens. The j-th draft of a request
gains the chance its first j drafts are all accepted; drafts are added in order of that
gain while tokens / predicted seconds still grows (a greedy marginal allocation over
the whole batch, vectorised). The cap only lowers the rule's k, so every invariant of
the throttle holds as before: the chosen k is what the step charges.

A choice that drafts nothing by a clear margin is held for the next few steps
(`holding`): while nobody drafts the estimates barely move, and deciding again costs
a measurable share of a short step.

That aim is right while a finished request's slot is refilled. When the caller says
nobody joins (offline `generate`) and nothing waits, the batch ends with its slowest
request, and scheduler/finish_plan.py chooses k to finish it soonest instead.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque

import numpy as np

from scheduler.budget import ThrottleRule
from scheduler.config import GoodputSettings
from scheduler.finish_plan import finish_caps
from scheduler.request import FRESH, NUM_OUTCOMES
from scheduler.step_cost import DraftCosts, StepTimeModel

# Where an answer's spans start, in output tokens: acceptance changes along an answer
# (a lookup drafter has more of the answer's own text to copy as it grows: ngram's
# first draft after a rejection, measured on held-out chat at 4 running, is accepted
# 0.06 of the time in the first 16 tokens, 0.16 up to 32 and 0.48 after), so the
# estimates are kept per span as well as per state.
SPAN_STARTS = (16, 32, 64, 128, 256)
NUM_SPANS = len(SPAN_STARTS) + 1
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


class AcceptanceEstimates:
    """Acceptance of a reached draft, per draft position, per state of the request's
    last verification and per span of the answer it is in, and per request.

    Pooled rates are shrunk toward the prior; each state's and each span's toward the
    pooled ones; each (state, span) cell toward the product of its state's and its
    span's effects (state rate x span rate / pooled rate), so a cell seen rarely is
    rated by what its row and its column say."""

    def __init__(self, max_k: int, settings: GoodputSettings) -> None:
        self.settings = settings
        # Decayed counts per state, span and draft position.
        self.accepted = np.zeros((NUM_OUTCOMES, NUM_SPANS, max_k))
        self.reached = np.zeros((NUM_OUTCOMES, NUM_SPANS, max_k))

    def record(self, verified: list[int], accepted: list[int],
               states: list[int] | None = None, produced: list[int] | None = None) -> None:
        """One step's verifications (drafts verified, accepted), each verified >= 1, the
        state each request was in before it (FRESH if not given) and its output tokens
        then (0 if not given). Position i was reached if i <= accepted (and i < verified)."""
        if not verified:
            return
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

    def pooled_rates(self) -> np.ndarray:
        """[K] acceptance of a reached draft at each position, all states and spans
        together, smoothed by the prior."""
        s = self.settings
        return _shrunk(self.accepted.sum(axis=(0, 1)), self.reached.sum(axis=(0, 1)),
                       np.asarray(s.prior_acceptance), s.prior_weight)

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
        reaches the first draft, so the ratio is fair), shrunk toward 1 by
        `request_weight` pseudo-verifications.

        A request's record and state fade, by half per `evidence_half_life` output
        tokens it made since its last verification (`unverified`; none if None), to
        its span's rates: a request that drafts nothing is never verified, so without
        this an early run of rejections parks it for good (measured: ngram at 4
        running, 315 of 403 request-steps parked in state "none accepted", while its
        drafts past the 32nd token are accepted 0.6-0.75 of the time)."""
        s = self.settings
        pooled = self.pooled_rates()
        by_state, by_span = self.position_rates(pooled), self.span_rates(pooled)
        cells = self.cell_rates(pooled, by_state, by_span)
        spans = span_of(produced) if produced is not None else np.zeros(len(states), dtype=int)
        own = cells[states, spans]
        if unverified is not None:
            weight = (0.5 ** (np.asarray(unverified, dtype=float) / s.evidence_half_life))
            verifications = verifications * weight[:, None]
            first_accepted = first_accepted * weight
            own = own * weight[:, None] + by_span[spans] * (1.0 - weight[:, None])
        first = float(pooled[0]) if len(pooled) else 0.0
        pseudo = s.request_weight * first
        expected = verifications @ by_state[:, 0] if len(pooled) else 0.0
        scale = (first_accepted + pseudo) / (expected + pseudo) if first > 0 else 1.0
        # Optimism shrinks with the request's own history and with the method's: once
        # the batch has verified hundreds of drafts, a fresh request is most likely
        # like them, and exploring it costs verification rows (and maybe a drafter
        # pass) that a batch of 64 pays on every request it tries.
        seen = float(self.reached[..., 0].sum())
        method_doubt = np.sqrt(s.prior_weight / (s.prior_weight + seen))
        bonus = s.explore * method_doubt / (1.0 + verifications.sum(axis=1))
        return own * np.reshape(scale, (-1, 1)), bonus


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


class GoodputPolicy:
    """Chooses each sampling request's k cap per step; see the module docstring."""

    def __init__(self, rule: ThrottleRule, max_num_batched_tokens: int,
                 settings: GoodputSettings | None = None,
                 time_model: StepTimeModel | None = None) -> None:
        self.settings = settings or GoodputSettings()
        self.max_k = rule.max_k
        self.budget = max_num_batched_tokens
        self.costs = DraftCosts.for_rule(rule)
        self.acceptance = AcceptanceEstimates(rule.max_k, self.settings)
        self.check = ForecastCheck(self.settings)
        kind = rule.method.drafter if rule.method is not None else None
        self.time_model = time_model or StepTimeModel(kind, self.settings)
        self.new_request_cap = rule.max_k  # for requests admitted this step
        # ... and without optimism, for those past the step's explorer slots.
        self.earned_request_cap = rule.max_k
        self._explore_slots = self.settings.max_explorers
        # Steps left to hold a decision that drafted nothing (`holding`), the running
        # count it was made for and by how much drafting lost then.
        self._idle_steps = self._idle_num = 0
        self._idle_margin = 0.0
        self._idle_planned = False  # whether the held decision was a closed batch's plan
        self._held = False  # whether this step's caps held such a plan

    def caps(self, verifications: np.ndarray, first_accepted: np.ndarray,
             states: np.ndarray, rule_k: np.ndarray,
             behind: np.ndarray | None = None,
             remaining: np.ndarray | None = None,
             unverified: np.ndarray | None = None,
             produced: np.ndarray | None = None) -> np.ndarray:
        """[N] the k cap of each running request (its verifications so far per state it
        was in [N, NUM_OUTCOMES], how many accepted their first draft, the state its last
        one left; rule_k: the k the rule allows it now; behind: the rows its drafter must
        catch up before its first draft, none if None; remaining: given only when the
        batch is closed (nothing waits, nobody joins), the output tokens each may still
        make, see scheduler/finish_plan.py; unverified: the output tokens each made
        since its last verification, whose record fades by them; produced: its output
        tokens, which say its span of the answer). Also sets
        `new_request_cap`, the cap of a request with no history in this batch."""
        num = len(rule_k)
        planned = remaining is not None and num > 0 and self.settings.finish_when_closed
        if self.holding(num, remaining is not None):
            return self.hold()
        self._held = False
        fresh = np.zeros(1, dtype=np.int64)
        own, bonus = self.acceptance.rates_and_optimism(
            np.concatenate([verifications, np.zeros((1, NUM_OUTCOMES), dtype=np.int64)]),
            np.concatenate([first_accepted, fresh]),
            np.concatenate([states, fresh + FRESH]),
            unverified=None if unverified is None else np.concatenate([unverified, fresh]),
            produced=None if produced is None else np.concatenate([produced, fresh]))
        limit = np.concatenate([rule_k, [self.max_k]])
        catch_up = np.zeros(num, dtype=np.int64) if behind is None else behind
        if planned and remaining is not None:
            # A plan drafts every request alike or not at all, so optimism there would
            # try drafts on the whole batch at once: at the mean, at the method's K.
            gains = self._gains(own)
            limit = np.minimum(limit, self._finish_plan(gains[:num], remaining, catch_up))
            gains[np.arange(self.max_k)[None, :] >= limit[:, None]] = 0.0
            caps = limit
            self.earned_request_cap = int(caps[num])  # nobody joins a closed batch
        else:
            gains = self._gains(own + bonus[:, None], limit)
            threshold, margin = self._threshold(gains[:num], max(num, 1), catch_up)
            caps = (gains >= threshold).sum(axis=1)
            caps = self._few_explorers(caps, self._gains(own, limit), threshold)
            # Held only where every request could have drafted: one in prefill now
            # may draft in a step or two.
            self._keep(margin if num and (rule_k > 0).all() else 0.0, num, planned=False)
        chosen = np.arange(self.max_k)[None, :] < caps[:, None]
        self.new_request_cap = int(caps[num])
        self.check.expect(float(gains[:num][chosen[:num]].sum()), int(caps[:num].sum()))
        return caps[:num]

    def _gains(self, rates: np.ndarray, limit: np.ndarray | None = None) -> np.ndarray:
        """[N, K] the chance each request's first j + 1 drafts are all accepted, by the
        forecast check's factor, 0 past its limit (if given)."""
        gains = np.minimum(np.cumprod(np.clip(rates, 0.0, 0.99), axis=1) * self.check.factor,
                           0.99)
        if limit is not None:
            gains[np.arange(self.max_k)[None, :] >= limit[:, None]] = 0.0
        return gains

    def _few_explorers(self, caps: np.ndarray, plain: np.ndarray,
                       threshold: float) -> np.ndarray:
        """`caps` [N + 1], the last a fresh request's, with at most `max_explorers` of
        the running requests drafting more than their rates without optimism earn
        (`plain` gains) at `threshold`: the first in running order, the oldest. The
        slots they leave go to the requests admitted this step (`admission_cap`)."""
        earned = (plain >= threshold).sum(axis=1)
        exploring = np.flatnonzero(caps[:-1] > earned[:-1])
        limit = self.settings.max_explorers
        caps = caps.copy()
        caps[exploring[limit:]] = earned[exploring[limit:]]
        self.earned_request_cap = int(earned[-1])
        self._explore_slots = max(limit - len(exploring), 0)
        return caps

    def admission_cap(self) -> int:
        """The k cap of the next request admitted this step: `new_request_cap` while
        explorer slots are left (`_few_explorers`), else what a fresh request's rates
        earn without optimism."""
        if self.new_request_cap <= self.earned_request_cap:
            return self.new_request_cap
        if self._explore_slots <= 0:
            return self.earned_request_cap
        self._explore_slots -= 1
        return self.new_request_cap

    def holding(self, num: int, closed: bool) -> bool:
        """Whether `num` running requests still hold a decision that drafted nothing by
        a clear margin (a closed batch's plan if the batch is `closed` and plans, else
        a step's choice; for as many requests or fewer, `_shrink_hold`): then `hold`
        is this step's caps, and the scheduler need not work out the rule's k first.
        The estimates barely move while nobody drafts, and deciding again costs
        ~0.6 ms in place at one request (measured: the forward evicts the policy's
        code and data from the caches), 4 % of a step."""
        planned = closed and num > 0 and self.settings.finish_when_closed
        if self._idle_steps <= 0 or planned != self._idle_planned or num > self._idle_num:
            return False
        if num < self._idle_num:
            self._shrink_hold(num)
        return self._idle_steps > 0

    def _shrink_hold(self, num: int) -> None:
        """Requests finished while a choice was held: hold it on for fewer of them only
        on the margin scaled by the count (measured: dflash's plans at 16 running on
        held-out chat fell short by 0.39 at 16 requests, 0.27 at 12, 0.18 at 8; with
        fewer requests a step's constant buys fewer tokens, and drafting gains). A
        batch that finishes a request a few steps had the policy decide again each
        time, a quarter of the steps at 16 running, 0.6 ms each in place."""
        self._idle_margin *= num / self._idle_num
        self._idle_num = num
        self._idle_steps = min(self._idle_steps,
                               int(self._idle_margin / self.settings.idle_margin_per_step))

    def _keep(self, margin: float, num: int, planned: bool) -> None:
        """Hold a decision that drafted nothing, `margin` short of paying (0.1: the
        best drafts predicted 10 % slower), one step per `idle_margin_per_step` of it,
        at most `max_idle_steps`."""
        settings = self.settings
        self._idle_steps = min(settings.max_idle_steps,
                               int(margin / settings.idle_margin_per_step))
        self._idle_num, self._idle_planned, self._idle_margin = num, planned, margin

    def hold(self) -> np.ndarray:
        """This step's caps while `holding`: nobody drafts."""
        self._idle_steps -= 1
        self._held = True
        self.new_request_cap = self.earned_request_cap = 0
        self.check.expect(0.0, 0)
        return np.zeros(self._idle_num, dtype=np.int64)

    def _finish_plan(self, gains: np.ndarray, remaining: np.ndarray,
                     catch_up: np.ndarray) -> np.ndarray:
        """[N + 1] the closed batch's plan (scheduler/finish_plan.py), the last entry for
        a request with no history. Planned at the method's K: a rule's k below it is
        passing (a prompt still in prefill drafts once it samples; near its end,
        `remaining` is small). A plan that drafts nothing by a clear margin is kept
        for the next steps (`GoodputSettings.idle_margin_per_step`)."""
        num = len(gains)
        settings = self.settings
        plan, margin = finish_caps(gains, np.full(num, self.max_k), remaining, catch_up,
                                   self.costs, self.time_model, self.budget,
                                   settings.finish_min_gain)
        self._keep(margin, num, planned=True)
        # Nobody joins a closed batch; a request preempted back into it waits, so the
        # next step plans per step again.
        return np.append(plan, plan.max())

    def _threshold(self, gains: np.ndarray, num_sampling: int,
                   catch_up: np.ndarray) -> tuple[float, float]:
        """The smallest gain worth a draft: drafts sorted by gain, the prefix that
        maximises (tokens) / (predicted seconds), within B rows of the target pass. A
        request's first draft also brings the rows its parked drafter catches up.
        Also, where no draft is worth it, by how much the best prefix falls short (its
        tokens per second under those without drafts, as a share; 0 where drafts win
        or none fits)."""
        k = self.max_k
        flat = gains.ravel()
        order = np.argsort(-flat, kind="stable")
        g = flat[order]
        j = order % k  # the draft's index in its request (0: the first draft)
        target = num_sampling + np.cumsum(self.costs.target[j])
        base = num_sampling * self.costs.drafter_base
        added = self.costs.drafter[j] + np.where(j == 0, catch_up[order // k], 0)
        drafter = np.concatenate([[base], base + np.cumsum(added)])
        # Every verification row gives logits, so the target rows here are logit rows.
        rows = np.concatenate([[num_sampling], target])
        seconds = self.time_model.predict_optimistic(rows, rows, drafter,
                                                     self.costs.passes(num_sampling, j))
        # A misfit that predicts less time for more rows must not reward drafting.
        seconds = np.maximum.accumulate(seconds)
        tokens = num_sampling + np.concatenate([[0.0], np.cumsum(g)])
        rate = tokens / seconds
        fits = np.concatenate([[True], (target <= self.budget) & (g > 0)])
        rate[~fits] = -np.inf
        best = int(np.argmax(rate))
        if best > 0:
            return float(g[best - 1]), 0.0
        runner_up = float(rate[1:].max(initial=-np.inf))
        return np.inf, (1.0 - runner_up / rate[0] if runner_up > 0 else 0.0)

    def observe_step(self, verified: list[int], accepted: list[int], states: list[int],
                     rows: tuple[int, int, int, int], seconds: float | None,
                     produced: list[int] | None = None) -> None:
        """What a step's results teach: its verifications (with the state each request
        was in and its output tokens then), and its time if measured, with its rows:
        target, logit, drafter, and the drafter's forward passes. A step that held a
        plan only joins the time model's sums: its next plan refits."""
        self.acceptance.record(verified, accepted, states, produced)
        self.check.settle(sum(accepted), sum(verified))
        if seconds is not None:
            self.time_model.observe(*rows, seconds, refit=not self._held)
