"""`draft_policy="goodput"`: each step, the k each sampling request proposes is the one
that maximises the step's expected output tokens per second.

Two online estimates, both owned by the policy and both injectable (tests seed them):

- `AcceptanceEstimates` (scheduler/acceptance.py): per draft position i, how often a
  draft that is reached (all drafts before it accepted) is accepted, kept per state the
  request's last verification had left when the draft's k was chosen (all accepted,
  some, none, no verification yet: drafts come in runs; scheduler/request.py) and per
  span of the answer it is in (a lookup drafter copies more as the answer grows),
  counted with decay so the estimate follows a changing workload. Each request's own
  record scales it (its first-draft acceptances over what its states predicted: a
  request that keeps rejecting stops drafting, one that accepts everything drafts the
  most); that record and its state fade while it goes unverified, so a request parked
  early is rated by its span again later. A request with little history gets a little
  optimism, so the estimates keep learning, less as the method's own record grows.
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
a measurable share of a short step. A choice that drafts is kept a few steps too, each
request's cap looked up by the state its last verification left
(scheduler/kept_choice.py).

That aim is right while a finished request's slot is refilled. When the caller says
nobody joins (offline `generate`) and nothing waits, the batch ends with its slowest
request, and scheduler/finish_plan.py chooses k to finish it soonest instead, on each
request's rates over the rest of its answer (`_long_run_gains`), while at least
`GoodputSettings.finish_min_running` run (fewer choose per step: measured, README).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from scheduler.acceptance import AcceptanceEstimates, ForecastCheck, ProposalRates
from scheduler.budget import ThrottleRule
from scheduler.config import GoodputSettings
from scheduler.finish_plan import finish_caps
from scheduler.kept_choice import KeptChoice
from scheduler.prefix_search import Best, PrefixSearch, SortedDrafts
from scheduler.request import FRESH, NUM_OUTCOMES
from scheduler.step_cost import DraftCosts, StepTimeModel


class GoodputPolicy:
    """Chooses each sampling request's k cap per step; see the module docstring."""

    def __init__(self, rule: ThrottleRule, max_num_batched_tokens: int,
                 settings: GoodputSettings | None = None,
                 time_model: StepTimeModel | None = None) -> None:
        self.settings = settings or GoodputSettings()
        self.max_k = rule.max_k
        self.budget = max_num_batched_tokens
        self.costs = DraftCosts.for_rule(rule)
        kind = rule.method.drafter if rule.method is not None else None
        self.acceptance = AcceptanceEstimates(rule.max_k, self.settings, kind)
        self.check = ForecastCheck(self.settings)
        self.proposals = ProposalRates(rule.max_k, self.settings.decay,
                                       self.settings.prior_proposals,
                                       self.settings.prior_weight)
        self.time_model = time_model or StepTimeModel(kind, self.settings)
        self.search = PrefixSearch(self.costs, self.time_model, max_num_batched_tokens,
                                   self.settings.exhaustive_prefixes)
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
        # The last decision that drafted, kept for the next steps (scheduler/kept_choice.py),
        # and the steps since it was made.
        self._kept: KeptChoice | None = None
        self._kept_steps = 0
        # Past `reuse_max_running` running: the last search's (threshold, depth, the
        # time model's fit count then) and the steps it has served (`_searched`).
        self._kept_threshold: tuple[float, int, int] | None = None
        self._threshold_steps = 0
        # The accepted drafts this step's caps are forecast to get, where a step's
        # choice (made now or kept) set them; None where a choice held drafts nothing
        # or a closed batch's plan set them. The scheduler prices a chain's next draft
        # at the rate it implies (`SchedulerOutput.draft_price`).
        self.forecast: float | None = None

    def caps(self, verifications: np.ndarray, first_accepted: np.ndarray,
             states: np.ndarray, rule_k: np.ndarray,
             behind: np.ndarray | None = None,
             remaining: np.ndarray | None = None,
             unverified: np.ndarray | None = None,
             produced: np.ndarray | None = None,
             left: np.ndarray | None = None) -> np.ndarray:
        """[N] the k cap of each running request (its verifications so far per state it
        was in [N, NUM_OUTCOMES], how many accepted their first draft, the state its last
        one left; rule_k: the k the rule allows it now; behind: the rows its drafter must
        catch up before its first draft, none if None; remaining: given only when the
        batch is closed (nothing waits, nobody joins), the output tokens each may still
        make, see scheduler/finish_plan.py; unverified: the output tokens each made
        since its last verification, whose record fades by them; produced: its output
        tokens, which say its span of the answer; left: the output tokens each may
        still make, open batch or closed, over which its catch-up is spread,
        `_spread_catch_up`). Also sets
        `new_request_cap`, the cap of a request with no history in this batch."""
        num = len(rule_k)
        planned = self._plans(num, remaining is not None)
        if self.holding(num, remaining is not None):
            return self.hold()
        self._held = False
        kept = self._kept_caps(verifications, states, rule_k, produced, planned)
        if kept is not None:
            return kept
        # Each request's record, and a fresh request's (no history) after them.
        fresh = np.zeros(1, dtype=np.int64)
        records = np.concatenate([verifications, np.zeros((1, NUM_OUTCOMES), dtype=np.int64)])
        firsts = np.concatenate([first_accepted, fresh])
        outputs = None if produced is None else np.concatenate([produced, fresh])
        limit = np.concatenate([rule_k, [self.max_k]])
        catch_up = np.zeros(num, dtype=np.int64) if behind is None else behind
        if planned and remaining is not None:
            caps, gains = self._planned_caps(records, firsts, outputs, limit, remaining,
                                             catch_up, verifications, produced)
        else:
            own, bonus = self.acceptance.rates_and_optimism(
                records, firsts, np.concatenate([states, fresh + FRESH]),
                unverified=None if unverified is None else np.concatenate([unverified, fresh]),
                produced=outputs)
            gains = self._gains(own + bonus[:, None], limit)
            threshold, price, margin, depth = self._searched(
                gains[:num], num, self._spread_catch_up(catch_up, left))
            gains[:, depth:] = 0.0
            limit = np.minimum(limit, depth)
            caps = (gains >= threshold).sum(axis=1)
            plain = self._gains(own, limit)
            caps, explorers = self._few_explorers(caps, plain, threshold)
            # Held only where every request could have drafted: one in prefill now
            # may draft in a step or two. Nobody drafting, nothing is verified and the
            # estimates stand still, so the choice is held at least as long as one
            # that drafts is kept (`_keep_choice`).
            eligible = bool(num) and bool((rule_k > 0).all()) and threshold == np.inf
            self._keep(margin if eligible else 0.0, num, planned=False,
                       at_least=self.settings.reuse_steps - 1
                       if eligible and self.time_model.settled else 0)
            self._keep_choice(caps[:num], gains[:num], price, verifications,
                              first_accepted, produced, bonus[:num] * explorers, depth)
            # The forecast the check holds to account is the estimates' own, without
            # the optimism that chose explorers: the optimism is a bet, not a forecast,
            # and counted in, it would scale every later forecast down for the bets.
            gains = plain
        chosen = np.arange(self.max_k)[None, :] < caps[:, None]
        self.new_request_cap = int(caps[num])
        forecast = float(gains[:num][chosen[:num]].sum())
        self.forecast = None if planned and remaining is not None else forecast
        self.check.expect(forecast, int(caps[:num].sum()))
        return caps[:num]

    def _planned_caps(self, records: np.ndarray, firsts: np.ndarray,
                      outputs: np.ndarray | None, limit: np.ndarray, remaining: np.ndarray,
                      catch_up: np.ndarray, verifications: np.ndarray,
                      produced: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """`caps` for a closed batch that plans (scheduler/finish_plan.py): [N + 1] the
        caps, the last a fresh request's, and the gains they were chosen on, 0 past each
        cap. `records`, `firsts`, `outputs` and `limit` carry the fresh request last."""
        num = len(verifications)
        self._kept_threshold = None
        # A plan drafts every request alike or not at all, so optimism there would
        # try drafts on the whole batch at once: at the mean, at the method's K.
        gains = self._long_run_gains(records, firsts, outputs)
        # The plan's horizon is its slowest request's, and a request whose drafter
        # proposes nothing on a step gains nothing on it: the rates are per draft
        # proposed (so is the forecast check in `caps`: it keeps `gains`). Read as if
        # every allowed draft were proposed, suffix's plans at 64 running drafted
        # the batch's tail and saved no step (`ProposalRates`, README). Not a gated
        # chain's: a chain whose drafts so far were accepted mostly goes on (eagle:
        # about 0.95 / 0.73 / 0.62 to its second / third / fourth draft, against 0.78
        # / 0.38 / 0.15 of all chains), so its gains stay per draft proposed, as in the
        # per-step search; its steps are priced by reach (`DraftCosts.with_reach`).
        proposed = gains if self.costs.sequential else gains * self.proposals.rates
        limit = np.minimum(limit, self._finish_plan(proposed[:num], remaining, catch_up))
        gains[np.arange(self.max_k)[None, :] >= limit[:, None]] = 0.0
        caps = limit
        self.earned_request_cap = int(caps[num])  # nobody joins a closed batch
        self._kept, self._kept_steps = None, 1
        if self._may_keep(caps[:num], produced):
            assert produced is not None
            self._kept = KeptChoice.of_plan(caps[:num], gains[:num], verifications,
                                            produced)
        return caps, gains

    def _kept_caps(self, verifications: np.ndarray, states: np.ndarray,
                   rule_k: np.ndarray, produced: np.ndarray | None,
                   planned: bool) -> np.ndarray | None:
        """This step's caps from the last decision that drafted (scheduler/kept_choice.py),
        or None where a decision is due (a plan's kept only while the batch is closed,
        a step's only while it is open)."""
        kept, self._kept = self._kept, None
        if (kept is None or kept.planned != planned or produced is None
                or self._kept_steps >= self.settings.reuse_steps):
            return None
        self._kept_steps += 1
        got = kept.caps_now(verifications, states, rule_k, produced, self._kept_steps)
        if got is None:
            return None
        self._kept = kept
        caps, forecast = got
        self.forecast = None if planned else forecast
        self.check.expect(forecast, int(caps.sum()))
        return caps

    def _spread_catch_up(self, catch_up: np.ndarray, left: np.ndarray | None) -> np.ndarray:
        """The catch-up rows the per-step search charges a parked request's first draft:
        its catch-up over `catch_up_steps` steps, or over the output tokens it may still
        make where fewer (each step makes at least one). The catch-up is paid once and
        serves every later draft; charged whole to the step that pays it, one draft's
        gain never paid for it, and a request parked early stayed parked to its end.
        The closed batch's plan (`_finish_plan`) sees the whole rest of the batch, so it
        charges the catch-up whole."""
        steps = np.full(len(catch_up), float(self.settings.catch_up_steps))
        if left is not None:
            steps = np.clip(left, 1.0, steps)
        return catch_up / steps

    def _keep_choice(self, caps: np.ndarray, gains: np.ndarray, price: float,
                     verifications: np.ndarray, first_accepted: np.ndarray,
                     produced: np.ndarray | None, bonus: np.ndarray, depth: int) -> None:
        """Keep a decision that drafts for the next steps, with each request's cap for
        every state its next verification may leave (its optimism only if it explores
        now) against the decision's `price` of a draft (scheduler/prefix_search.py),
        never past its `depth`; a verification resets what it made unverified. Not
        while the time model is young: its first steps move it most (the first
        drafting steps may show rows to be nearly free)."""
        self._kept, self._kept_steps = None, 1
        if not self._may_keep(caps, produced):
            return
        assert produced is not None
        by_state = self._gains_by_state(verifications, first_accepted, produced, bonus)
        by_state[..., depth:] = 0.0  # the decision's deepest draft holds in every state
        self._kept = KeptChoice.of(caps, gains, by_state, price, verifications, produced)

    def _may_keep(self, caps: np.ndarray, produced: np.ndarray | None) -> bool:
        """Whether a decision with these caps is kept for the next steps: one that
        drafts (one that does not is held, `holding`) for at most `reuse_max_running`
        requests, once the time model has settled."""
        settings = self.settings
        return (settings.reuse_steps > 1 and len(caps) <= settings.reuse_max_running
                and bool(caps.any()) and produced is not None and self.time_model.settled)

    def _gains_by_state(self, verifications: np.ndarray, first_accepted: np.ndarray,
                        produced: np.ndarray | None,
                        bonus: np.ndarray | None = None) -> np.ndarray:
        """[N, NUM_OUTCOMES, K] each request's `_gains` in each state its next
        verification may leave (its record as it stands, nothing unverified; `bonus`
        [N] added to its rates if given)."""
        rates = self.acceptance.rates_by_state(verifications, first_accepted, produced)
        if bonus is not None:
            rates = rates + bonus[:, None, None]
        return self._gains(rates)

    def _long_run_gains(self, verifications: np.ndarray, first_accepted: np.ndarray,
                        produced: np.ndarray | None) -> np.ndarray:
        """[N, K] each request's gains over the rest of its answer: its gains in each
        state, weighed by how often it is in that state (`AcceptanceEstimates.
        state_mix`). A plan spans many steps, over which the state moves with every
        verification; planned on the state of the moment, the request that had just
        rejected its drafts was the one the batch waited for, and it set the plan
        (measured, dflash at 4 running: the plan drafted less than a step's choice and
        ran 0.96x speculation off against 0.98x, README)."""
        by_state = self._gains_by_state(verifications, first_accepted, produced)
        mix = self.acceptance.state_mix(verifications)
        return (mix[:, :, None] * by_state).sum(axis=1)

    def _gains(self, rates: np.ndarray, limit: np.ndarray | None = None) -> np.ndarray:
        """[N, K] (or [..., K]) the chance each request's first j + 1 drafts are all
        accepted, by the forecast check's factor, 0 past its limit (if given, [N])."""
        gains = np.minimum(np.cumprod(np.clip(rates, 0.0, 0.99), axis=-1) * self.check.factor,
                           0.99)
        if limit is not None:
            gains[np.arange(self.max_k)[None, :] >= limit[:, None]] = 0.0
        return gains

    def _few_explorers(self, caps: np.ndarray, plain: np.ndarray,
                       threshold: float) -> tuple[np.ndarray, np.ndarray]:
        """`caps` [N + 1], the last a fresh request's, with at most `max_explorers` of
        the running requests drafting more than their rates without optimism earn
        (`plain` gains) at `threshold`: the first in running order, the oldest. The
        slots they leave go to the requests admitted this step (`admission_cap`). Also
        [N] 1 for each running request that drafts on its optimism, else 0."""
        earned = (plain >= threshold).sum(axis=1)
        exploring = np.flatnonzero(caps[:-1] > earned[:-1])
        limit = self.settings.max_explorers
        caps = caps.copy()
        caps[exploring[limit:]] = earned[exploring[limit:]]
        self.earned_request_cap = int(earned[-1])
        self._explore_slots = max(limit - len(exploring), 0)
        explorers = np.zeros(len(caps) - 1)
        explorers[exploring[:limit]] = 1.0
        return caps, explorers

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
        planned = self._plans(num, closed)
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

    def _keep(self, margin: float, num: int, planned: bool, at_least: int = 0) -> None:
        """Hold a decision that drafted nothing, `margin` short of paying (0.1: the
        best drafts predicted 10 % slower), one step per `idle_margin_per_step` of it,
        and `at_least` steps, at most `max_idle_steps`. A plan with drafts that cannot
        fit at all (no k but 0 within B) falls short by an infinite margin: held the
        most, its margin made finite for `_shrink_hold` to scale."""
        settings = self.settings
        if margin == np.inf:
            margin = settings.max_idle_steps * settings.idle_margin_per_step
        self._idle_steps = min(settings.max_idle_steps,
                               max(int(margin / settings.idle_margin_per_step), at_least))
        self._idle_num, self._idle_planned, self._idle_margin = num, planned, margin

    def _plans(self, num: int, closed: bool) -> bool:
        """Whether `num` running requests, in a batch nobody joins if `closed`, get a
        closed batch's plan (scheduler/finish_plan.py) rather than a step's choice."""
        settings = self.settings
        return closed and num >= max(settings.finish_min_running, 1) and settings.finish_when_closed

    def hold(self) -> np.ndarray:
        """This step's caps while `holding`: nobody drafts."""
        self._idle_steps -= 1
        self._held = True
        self._kept = self._kept_threshold = None
        self.forecast = None
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
                                   self.costs.with_reach(self.proposals.rates, num),
                                   self.time_model, self.budget,
                                   settings.finish_min_gain)
        idle = not plan.any() and self.time_model.settled
        self._keep(margin, num, planned=True, at_least=settings.reuse_steps - 1 if idle else 0)
        # Nobody joins a closed batch; a request preempted back into it waits, so the
        # next step plans per step again.
        return np.append(plan, plan.max())

    def _searched(self, gains: np.ndarray, num: int,
                  catch_up: np.ndarray) -> tuple[float, float, float, int]:
        """`_threshold`'s (threshold, price, margin, depth), or past `reuse_max_running`
        running the last one's price as the threshold, for `reuse_steps` steps in all
        and while the time model's fit it priced with stands (a young fit is refitted
        every step): each request's cap still comes from its own gains this step, held
        to the kept price of a draft. With hundreds running one step moves that price
        little, and the search is most of a decision there (eagle at 256 running
        searches four depths of 256-1,024 drafts, measured by
        `benchmarks/goodput_cost.py`, README)."""
        settings = self.settings
        kept, fit = self._kept_threshold, self.time_model.refits
        if (kept is not None and num > settings.reuse_max_running and kept[2] == fit
                and self._threshold_steps < settings.reuse_steps):
            self._threshold_steps += 1
            return kept[0], kept[0], 0.0, kept[1]
        threshold, price, margin, depth = self._threshold(gains, max(num, 1), catch_up)
        # The fit as the search left it (a search may refit first). A search that
        # drafts nothing is kept too (its price inf: caps 0), where its margin is
        # too small to hold it (`holding`).
        large = num > settings.reuse_max_running
        self._kept_threshold = (price, depth, self.time_model.refits) if large else None
        self._threshold_steps = 1
        return threshold, price, margin, depth

    def _threshold(self, gains: np.ndarray, num_sampling: int,
                   catch_up: np.ndarray) -> tuple[float, float, float, int]:
        """The smallest gain worth a draft, the price of a draft there
        (scheduler/prefix_search.py) and the deepest draft allowed: the best prefix
        over all drafts and, for a sequential drafter, over the drafts of each depth
        d < K alone (those with index < d; the drafts are sorted once for every
        depth). Its every draft past a
        request's first adds a one-row pass for the whole step, and sorted by gain one
        request's second draft may come before another's first; then every prefix that
        drafts for all pays that pass, and the best was to draft one or two requests
        (measured: eagle at 4 running, goodput's steps cost fixed K = 2's and made
        fixed K = 1's tokens; this alone did not close that gap, README). Also, where
        no draft is worth it at any depth, by how much the best prefix falls short."""
        drafts = SortedDrafts.of(gains)
        search = self.search
        if self.costs.sequential:
            costs = self.costs.with_reach(self.proposals.rates, num_sampling)
            if costs is not self.costs:
                search = replace(search, costs=costs)
        found = (search.best_by_depth(drafts, num_sampling, catch_up, self.max_k)
                 if self.costs.sequential
                 else [search.best(drafts, num_sampling, catch_up)])
        depths = range(1, self.max_k + 1) if self.costs.sequential else (self.max_k,)
        best: Best | None = None
        best_depth, shortfall = self.max_k, np.inf
        for depth, got in zip(depths, found, strict=True):
            if got.threshold < np.inf and (best is None or got.rate > best.rate):
                best, best_depth = got, depth
            shortfall = min(shortfall, got.margin)
        if best is not None:
            return best.threshold, best.price, 0.0, best_depth
        return np.inf, np.inf, (shortfall if shortfall < np.inf else 0.0), self.max_k

    def chain_steps(self, deepest: int, num_sampling: int) -> float:
        """A chain drafter's one-row steps expected of a step whose deepest request is
        allowed `deepest` drafts (`DraftCosts.with_reach`)."""
        costs = self.costs.with_reach(self.proposals.rates, num_sampling)
        return float(costs.one_row_steps(np.array([deepest]))[0])

    def observe_proposals(self, allowed: list[int], proposed: list[int]) -> None:
        """A step's requests that were allowed drafts: how many each was allowed, and
        how many its drafter proposed (`ProposalRates`)."""
        self.proposals.record(allowed, proposed)

    def observe_finished(self, verifications: list[int], first_accepted: int) -> None:
        """A request left the batch: how its own acceptance strayed from its states'
        rates teaches how much the next requests' own records count."""
        self.acceptance.record_finished(verifications, first_accepted)

    def observe_step(self, verified: list[int], accepted: list[int], states: list[int],
                     rows: tuple[int, int, int, int], seconds: float | None,
                     produced: list[int] | None = None,
                     drafter_seconds: float | None = None) -> None:
        """What a step's results teach: its verifications (with the state each request
        was in and its output tokens then), and its time if measured, with its rows:
        target, logit, drafter, and the drafter's forward passes (and the share of its
        time those passes took, if timed apart). A step that held a plan only joins the
        time model's sums: its next plan refits."""
        self.acceptance.record(verified, accepted, states, produced)
        self.check.settle(sum(accepted), sum(verified))
        if seconds is not None:
            self.time_model.observe(*rows, seconds, refit=not self._held,
                                    drafter_seconds=drafter_seconds)
