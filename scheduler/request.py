"""Per-request state: one class, counters stored, everything else derived."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass

# The state a request's last verification left: drafts come in runs (a lookup drafter
# copying a span accepts nearly every draft until the span ends), so it predicts the
# next acceptance best. Measured on held-out chat at K = 4, ngram's first draft was
# accepted 0.87 of the time after a fully accepted verification, 0.20 after a fully
# rejected one. The goodput draft policy keeps its acceptance estimates per state.
FRESH, ALL_ACCEPTED, SOME_ACCEPTED, NONE_ACCEPTED = range(4)
NUM_OUTCOMES = 4


def outcome(verified: int, accepted: int) -> int:
    """The state a verification of `verified` >= 1 drafts, `accepted` of them, leaves."""
    if accepted >= verified:
        return ALL_ACCEPTED
    return SOME_ACCEPTED if accepted else NONE_ACCEPTED


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    `top_k=0` and `top_p=1.0` turn those filters off; `temperature=0.0` is greedy.
    Stop strings (`stop`) are matched by the engine's detokenizer, not here.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        def bad(name: str, limit: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {limit}, got {getattr(self, name)!r}")

        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise bad(name, "a finite number")
        # Integers are range-checked, never clamped: they end up in int64 arrays, where
        # an out-of-range value would raise inside an engine step (OverflowError) and
        # fail every request of that step instead of only this one.
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "True or False")
        _check_int(self, "max_tokens", 1, INT64_MAX)
        _check_int(self, "top_k", 0, INT64_MAX, " (0 = off)")
        _check_int(self, "min_tokens", 0, self.max_tokens, " (at most max_tokens)")
        if self.logprobs is not None:
            _check_int(self, "logprobs", 0, MAX_LOGPROBS)
        if self.seed is not None:
            _check_int(self, "seed", INT64_MIN, INT64_MAX)
        if self.temperature < 0:
            raise bad("temperature", ">= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for i, token in enumerate(self.stop_token_ids):
            if isinstance(token, bool) or not isinstance(token, int) \
                    or not 0 <= token <= INT64_MAX:
                raise ValueError(f"SamplingParams.stop_token_ids[{i}] must be an integer in "
                                 f"[0, {INT64_MAX}], got {token!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a sequence of non-empty strings")


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# The most top logprobs one token may ask for (vLLM's default max_logprobs, OpenAI's cap).
MAX_LOGPROBS = 20


def _check_int(params: SamplingParams, name: str, low: int, high: int, note: str = "") -> None:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"SamplingParams.{name} must be an integer in [{low}, {high}]"
                         f"{note}, got {value!r}")


class RequestStatus(enum.IntEnum):
    """Lifecycle; every status above PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # a step that ran it failed, and the fault was traced to it

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request as the scheduler tracks it.

    Known tokens are the prompt plus the outputs so far; `num_computed_tokens` counts
    those whose KV is in the cache. Draft tokens (`spec_token_ids`) are proposed, not
    known: when the scheduler runs them they count as computed until the verifier
    rejects them, and `update_from_output` rolls the rejected ones back.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        eos_token_id: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        # Prompt + outputs in one list, so block hashing reads slices without copies.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.spec_token_ids: list[int] = []
        # The draft it would have proposed while parked (`SchedulerOutput.shadow_req_ids`),
        # checked against the token it samples next; never verified by the target.
        self.shadow_token_id: int | None = None
        self.num_computed_tokens = 0
        # Positions its drafter's own KV holds (a head or draft LM method): the computed
        # ones, or fewer while it is parked (it samples with k = 0 and skips the
        # drafter); the gap is caught up in the step it next drafts.
        self.num_drafter_computed = 0
        self.num_preemptions = 0
        self.stop_token_id: int | None = None
        # In a step that failed, alongside others: it runs as the only suspect of its
        # steps until it samples once, so a fault it causes again is traced to it.
        self.suspect = False
        # For the goodput draft policy: its verifications so far, per state its drafts
        # were chosen in, how many accepted their first draft, the state the last one
        # left, and the state the drafts it now holds were chosen in. The policy
        # compares its first-draft acceptances with what its states predict (every
        # verification reaches the first draft: the comparison is fair).
        self.verifications_by_state = [0] * NUM_OUTCOMES
        self.num_first_accepted = 0
        self.last_outcome = FRESH
        # A step's k is chosen before that step verifies, so its drafts were chosen
        # knowing the state the verification before left, not the one made as they
        # were proposed: that is the state they are counted under. Measured, eagle's
        # trained head at 4 running on held-out chat: counted as proposed, the rates
        # after all and after none accepted were 0.48 and 0.36 where the drafts chosen
        # in those states were accepted 0.44 and 0.38; counted as chosen, 0.43 and
        # 0.41 against 0.42 and 0.40.
        self.drafted_in = FRESH
        # Its output tokens at its last verification: what a request's record says
        # fades while it drafts nothing (`GoodputSettings.evidence_half_life`).
        self.last_verified_output = 0

    def record_verification(self, verified: int, accepted: int) -> int:
        """`verified` drafts checked by the target, the first `accepted` of them right;
        returns the state they are counted under (the policy's estimates count them
        there too)."""
        state = self.drafted_in
        self.verifications_by_state[state] += 1
        self.num_first_accepted += accepted > 0
        self.last_verified_output = len(self.output_token_ids)
        if verified:
            self.last_outcome = outcome(verified, accepted)
        return state

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, "
            f"spec={len(self.spec_token_ids)})"
        )
