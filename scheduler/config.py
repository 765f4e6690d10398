"""Frozen, validated configs for the scheduler and the KV cache.

Values found at run time (the number of KV blocks a memory budget buys, the EOS id)
never get written back into these: they travel in separate result objects.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step.

    `max_num_batched_tokens` (B) bounds the rows of every forward pass the step runs,
    the target's and each drafter pass alike. `long_prefill_token_threshold` (0 = off)
    caps one request's chunk so a long prompt cannot take the whole step.
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1 (got {getattr(self, name)})")
        if self.policy not in POLICIES:
            raise ValueError(
                f"SchedulerConfig.policy={self.policy!r} is not supported; choose one of "
                f"{', '.join(POLICIES)}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "SchedulerConfig.long_prefill_token_threshold must be >= 0 (0 = off), got "
                f"{self.long_prefill_token_threshold}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "SchedulerConfig.max_num_batched_tokens must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill=False, got "
                f"{self.max_num_batched_tokens}: a whole prompt must fit in one step"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape: `num_blocks` blocks of `block_size` token slots each."""

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"CacheConfig.block_size must be >= 1 (got {self.block_size})")
        if self.num_blocks < 1:
            raise ValueError(f"CacheConfig.num_blocks must be >= 1 (got {self.num_blocks})")


STEP_PRIORS = ("cpu", "gpu")  # GoodputSettings.step_prior


def by_position(values: tuple[float, ...], max_k: int) -> tuple[float, ...]:
    """A prior's values for draft positions 1..max_k: the last repeated."""
    return (tuple(values) + tuple(values[-1:]) * max_k)[:max_k]


@dataclass(frozen=True)
class GoodputSettings:
    """The policy's knobs; the defaults serve, tests pin them."""

    # Acceptance of a reached draft before any verification: one figure for every
    # position, or one per position (the last repeated). A trained head brings its
    # own, measured when it was trained (`ModelRunner.drafter_acceptance`): eagle's
    # first draft is accepted 0.36 of the time served, and a fresh engine that
    # assumed 0.5 drafted at 16 running where it lost (measured: README).
    prior_acceptance: float | tuple[float, ...] = 0.5
    prior_weight: float = 8.0  # pseudo-observations behind that prior
    # Verifications the prior was measured on (a trained head's served figure; 0 for
    # the generic 0.5), counted in the method's doubt that earns a fresh request its
    # optimism (`explore`), not in the rates, which still yield to this workload's
    # own verifications after `prior_weight` of them.
    prior_evidence: float = 0.0
    # The chance a chain drafter allowed j drafts proposes its j-th, per position j,
    # before any step is seen: a trained head's, measured with its confidence gate
    # (runner/draft_gate.py) when it was trained; empty: every allowed draft proposed.
    # Behind `prior_weight` pseudo-observations, as the acceptance prior.
    prior_proposals: tuple[float, ...] = ()
    # A request's own history counts after this many verifications, until
    # `spread_min_requests` have finished; then the spread of finished requests' own
    # acceptance sets it, within [1, max_request_weight]. None: the figure measured for
    # the method's drafter kind (scheduler/request_spread.py: a head's requests spread
    # about half as much as a lookup drafter's, so their own records count later).
    request_weight: float | None = None
    spread_min_requests: int = 16
    spread_decay: float = 0.99  # per finished request: a window of ~100
    max_request_weight: float = 64.0
    # Of the global counts, per verification recorded (not per step: at one request a
    # step verifies at most once, at 64 sixty-four times; the window is ~1,000 either way).
    decay: float = 0.999
    explore: float = 0.2  # optimism for a request with no history, ~ 1 / (1 + seen)
    # Requests that may draft on that optimism in one step (running ones first, then
    # those admitted): a few verifications teach a fresh method what a whole batch
    # would, and at 64 running a fresh engine had ~70 requests try dflash's drafts at
    # once (K = 4 each; measured 0.95x off, where it drafts almost nothing after).
    max_explorers: int = 4
    # Output tokens over which a request's own record (and the state its last
    # verification left) loses half its weight while it goes unverified: acceptance
    # changes along an answer (ngram's first draft, measured on held-out chat: 0.2 in
    # the first 32 tokens, 0.6-0.75 after), and a parked request learns nothing new.
    evidence_half_life: float = 16.0
    # Where a method's drafts cost no rows (`SpecMethod.shadows`: ngram), a parked
    # request's draft is proposed anyway and checked against the token it samples
    # next, so its record and state stay current (`SchedulerOutput.shadow_req_ids`):
    # for at most this many requests a step, in turn (0: none). Each costs the runner
    # a proposal (ngram: 3-6 us) and the scheduler a check: at 1,024 running, all of
    # them parked, checking every one added 0.8 ms to a 2.3 ms scheduler step
    # (`benchmarks/goodput_cost.py`), and proposing for each ~5 ms to the runner's.
    max_shadows: int = 64
    # The acceptance estimates' rate tables are rebuilt once the verifications since
    # the last build exceed this share of those they were built on (0: every step).
    stale_share: float = 1 / 64
    forgetting: float = 0.995  # of the step-time fit's data, per observed step
    # The step-time model's prior by where the forward runs (scheduler/step_cost.py):
    # "cpu", measured on this project's CPU, where a row past the first few costs ~1 ms;
    # "gpu", measured on an H200, where a step costs its kernel launches whatever its
    # rows. The engine picks it by its device. A prior that prices rows too high is
    # never corrected where nobody drafts: on an H200's clock (simulated, eagle at 16
    # running, benchmarks/goodput_clock.py) goodput with the CPU's prior ran 0.91 of
    # the best fixed K, with this one 0.96.
    step_prior: str = "cpu"
    # A step is fitted as at most this many times what the fit priced it (its drafter's
    # share scaled alike): a one-off stall (a kernel compiled on its first shape, a
    # page fault, the host preempting the process) is not a price. Squared error let
    # one such step set prices for the ~200 it stays in the window (measured on an
    # H200: the first engine of a process, its kernels compiling, predicted 116 ms a
    # step against 42 measured, and drafted K = 4 for most requests where K = 2 won).
    # Only a step after calm ones is capped (StepTimeModel `_clip_stalls`): where the
    # fit itself is that far low, the steps after the first are fitted in full.
    outlier_ratio: float = 4.0
    # The step-time model is refitted once this many steps that teach it wait (every
    # step over its first few): a fit and its inverse each step cost ~0.1 ms in place
    # at 4 running, and a fit 3 steps old prices a window of ~200 steps as well.
    refit_every: int = 4
    # Standard deviations by which the time model's price of extra rows is taken low
    # (exploration: an operating point never left teaches no slope; without it, ngram
    # at one request stopped drafting on the prior's price of a row and ran at 0.90x
    # speculation off, against 1.54x with it, measured) ...
    optimism: float = 1.0
    # ... but never below this share of their mean price: the fit forgets, so its
    # spread regrows while nobody drafts, and at 64 running an unbounded discount had
    # dflash draft all 34 requests at a forecast first-draft acceptance of 0.15 every
    # ~10 steps to the end (measured).
    optimism_floor: float = 0.5
    # Drafts behind the forecast check's prior (that forecasts are right).
    forecast_weight: float = 16.0
    # With nothing waiting and nobody to join (`closed`), plan k to finish the batch
    # soonest (scheduler/finish_plan.py) instead of per step.
    finish_when_closed: bool = True
    # ... while at least this many run; fewer choose per step. Measured side by side
    # (benchmarks/goodput_ab.py: held-out chat, trained heads, 8 requests through 4
    # slots, so the second half of each run is a closed batch; README): at 4 running
    # the plan ran dflash at 0.96-1.00x speculation off and per-step choices at
    # 1.01-1.04x (parallel 1.07-1.10 against 1.11-1.12); at 16 both alike; at 64 the
    # plan was ahead by 0-2.5 % (ngram 0.987-0.989 against 0.970-0.976).
    finish_min_running: int = 16
    # ... drafting only where the plan saves at least this share of the time without
    # drafts: where it barely pays, the estimates' errors decide (measured at 16
    # running: plans forecast to save 6-12 % drafted the whole batch and lost).
    finish_min_gain: float = 0.05
    # A choice that drafts nothing (a closed batch's plan, or a step's), with drafting
    # predicted this much slower, is held a step per this share (at most
    # `max_idle_steps` in a row, and only while no request joins; a finish scales the
    # margin by the count left): the estimates barely move while nobody drafts, and
    # deciding again cost ~0.6 ms in place per step at 1 and 16 running (measured),
    # 2-4 % of a step.
    idle_margin_per_step: float = 0.02
    # ... up to one `evidence_half_life` of steps: a held request's own record has lost
    # half its weight by then, and its rates may have moved (measured at 16 running,
    # capped at 8: a third of the decisions were a held choice running out).
    max_idle_steps: int = 16
    # A choice that drafts is kept, looked up by each request's state, for this many
    # steps in all (scheduler/kept_choice.py; 1: decide every step): deciding cost
    # ~0.6 ms in place at 4 and 16 running (measured), 1.5-3 % of a step at 1-4.
    reuse_steps: int = 4
    # ... while at most this many run: past it a request finishes or joins nearly every
    # step, so a kept choice is rarely looked up, and working out every request's cap
    # per state cost more than it saved (the scheduler's step at 256 running, ngram,
    # simulated: 1.48 ms kept against 1.35 ms not; at 1,024, 5.96 against 4.72). Past
    # it, only the search's threshold is kept for `reuse_steps` steps instead, each
    # request capped by its own gains against it (`GoodputPolicy._searched`): with
    # this many running the threshold is a price, where with two it was one request's
    # gain and cut an accepting pair from K to 2 a step later.
    reuse_max_running: int = 32
    # Prefixes of the sorted drafts a decision prices one by one at most; past it, a
    # grid of about as many and then the prefixes near its best (scheduler/
    # prefix_search.py): pricing all 4,097 at 1,024 running, K = 4, was most of a
    # decision. 256 prices every prefix up to 64 running at K = 4.
    exhaustive_prefixes: int = 256
    # A parked request's catch-up (the rows its drafter skipped) is paid once, and buys
    # every step it drafts after: the per-step search spreads it over this many steps
    # (at most the output tokens the request may still make; 1: all on the step that
    # pays it). Priced whole, a request parked for a few steps never drafted again: its
    # catch-up grew each step against one draft's gain (measured at 4 running,
    # bfloat16: parallel parked 339 of 390 request-steps and ran 0.964x off against
    # fixed K = 1's 1.110x). Spread over 16 steps it ran 1.061x, but at 16 running,
    # where a request soon parks again, the spread undercharged it and goodput drafted
    # twice as much and lost ~2 % (0.97-0.98x off against 0.99-1.00); 4 and 8 sat
    # between, within the runs' noise (README).
    catch_up_steps: int = 8

    def __post_init__(self) -> None:
        if not self.outlier_ratio > 1.0:  # at or below 1, every step would be capped
            raise ValueError(f"GoodputSettings.outlier_ratio must be > 1 (times a step's "
                             f"price), got {self.outlier_ratio!r}")
        if self.step_prior not in STEP_PRIORS:
            raise ValueError(f"GoodputSettings.step_prior must be one of "
                             f"{', '.join(STEP_PRIORS)}, got {self.step_prior!r}")
        values = self._prior_values()
        if not values or not all(0.0 <= v <= 1.0 for v in values):
            raise ValueError(f"GoodputSettings.prior_acceptance must be one or more "
                             f"acceptance rates in [0, 1], got {self.prior_acceptance!r}")
        if not all(0.0 <= float(v) <= 1.0 for v in self.prior_proposals):
            raise ValueError(f"GoodputSettings.prior_proposals must be rates in [0, 1], "
                             f"got {self.prior_proposals!r}")
        if not self.prior_evidence >= 0.0:
            raise ValueError(f"GoodputSettings.prior_evidence must be >= 0 "
                             f"verifications, got {self.prior_evidence!r}")
        if not self.max_request_weight >= 1.0:
            raise ValueError(f"GoodputSettings.max_request_weight must be >= 1 verification, "
                             f"got {self.max_request_weight!r}")
        if self.request_weight is not None and not (
                1.0 <= self.request_weight <= self.max_request_weight):
            raise ValueError(f"GoodputSettings.request_weight must be in [1, max_request_weight="
                             f"{self.max_request_weight!r}], got {self.request_weight!r}")
        if self.spread_min_requests < 2:
            raise ValueError(f"GoodputSettings.spread_min_requests must be >= 2 (a spread "
                             f"needs two requests), got {self.spread_min_requests!r}")
        if not 0.0 < self.spread_decay <= 1.0:
            raise ValueError(f"GoodputSettings.spread_decay must be in (0, 1], "
                             f"got {self.spread_decay!r}")
        if self.catch_up_steps < 1:
            raise ValueError(f"GoodputSettings.catch_up_steps must be >= 1 step, "
                             f"got {self.catch_up_steps!r}")
        if self.exhaustive_prefixes < 2:
            raise ValueError(f"GoodputSettings.exhaustive_prefixes must be >= 2 (a grid "
                             f"needs two points), got {self.exhaustive_prefixes!r}")
        if self.max_shadows < 0:
            raise ValueError(f"GoodputSettings.max_shadows must be >= 0 requests a step "
                             f"(0: none), got {self.max_shadows!r}")

    def _prior_values(self) -> tuple[float, ...]:
        prior = self.prior_acceptance
        return tuple(float(v) for v in (prior if isinstance(prior, tuple) else (prior,)))

    def prior_by_position(self, max_k: int) -> tuple[float, ...]:
        """`prior_acceptance` for draft positions 1..max_k (a tuple's last repeated)."""
        return by_position(self._prior_values(), max_k)
