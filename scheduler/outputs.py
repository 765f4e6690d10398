"""The two plain dataclasses the scheduler and the runner exchange, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import SamplingParams
from spec_decode.price import DraftPrice


@dataclass(frozen=True)
class NewRequestData:
    """Everything the runner needs to start (or restart after preemption) a request."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # The request's end-of-sequence token: until min_tokens, the runner keeps it (and
    # the stop token ids) from being sampled.
    eos_token_id: int | None = None
    # Positions of the cached prefix whose drafter KV is valid (a prefix cached while
    # its request was parked holds target KV only); None: all num_computed_tokens.
    num_drafter_computed: int | None = None

    @property
    def num_drafter_computed_tokens(self) -> int:
        return (self.num_computed_tokens if self.num_drafter_computed is None
                else self.num_drafter_computed)


@dataclass(frozen=True)
class CachedRequestData:
    """What changed for the requests the runner already holds: entry i of each list
    is request `req_ids[i]` (one object per step, not one per request: a step may
    carry thousands)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks appended
    num_computed_tokens: list[int] = field(default_factory=list)  # before the step

    def __len__(self) -> int:
        return len(self.req_ids)

    def num_new_blocks(self) -> dict[str, int]:
        return {rid: len(ids) for rid, ids in zip(self.req_ids, self.new_block_ids)}


@dataclass
class SchedulerOutput:
    """One step's plan, and what it charged against each forward pass's budget.

    `num_scheduled_tokens[r]` = n, the target rows of request r (1 + its verified
    drafts when decoding). `num_draft_tokens[r]` = k, the drafts r proposes this step.
    `pass_rows` maps each forward pass ("target", then the drafter's passes) to the rows
    charged to it; `num_drafter_tokens` is the widest drafter pass, which the runner
    checks against the rows it really builds. `adapted_draft_tokens[r]` is the k the
    rule allowed, for each request whose k the adaptive draft policy cut to fit.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    num_draft_tokens: dict[str, int]
    num_drafter_tokens: int
    pass_rows: dict[str, int]
    adapted_draft_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    # Parked requests (sampling, k = 0) whose next draft the runner proposes all the same
    # and returns as `ModelRunnerOutput.shadow_token_ids`, never verified: the goodput
    # policy checks it against the token each samples next (`SpecMethod.shadows`).
    shadow_req_ids: list[str] = field(default_factory=list)
    # What a chain's next draft must gain to pay for its rows and passes this step (the
    # goodput policy's step-time model at its forecast rate), None where the policy
    # made no such forecast: a trained chain drafter stops a chain whose next draft is
    # worth less (runner/draft_gate.py). Only which drafts are proposed moves, never
    # the budget: the step charged the rows of every allowed draft.
    draft_price: DraftPrice | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


@dataclass
class ModelRunnerOutput:
    """What one step produced, in the order of `req_ids`.

    `sampled_token_ids[i]`: the accepted drafts then one bonus or recovered token, or
    `[]` for a request whose chunk did not reach a sampling position.
    `draft_token_ids[r]`: the k drafts r proposes for the next step to verify.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Rows the runner built per forward pass, for metrics and tests.
    pass_rows: dict[str, int] = field(default_factory=dict)
    # Per request asking for logprobs, one (token ids, logprobs) per emitted token: the
    # emitted token first, then the top n (verification emits several per step).
    logprobs: dict[str, list[tuple[list[int], list[float]]]] = field(default_factory=dict)
    # Wall seconds the step took, as the runner measured it (the goodput draft policy
    # fits its step-time model to it); None where nothing was measured.
    step_seconds: float | None = None
    # ... of which the drafter's passes took this many (where it ran any): the policy
    # fits the target's and the drafter's costs apart from it (scheduler/step_cost.py).
    drafter_seconds: float | None = None
    # The first draft each of `SchedulerOutput.shadow_req_ids` would have proposed.
    shadow_token_ids: dict[str, int] = field(default_factory=dict)
    # Verifications that won a token from a drafted tree's leaf (runner/draft_tree.py).
    leaf_hits: int = 0


@dataclass(slots=True)  # one per request per step: keep it cheap
class EngineCoreOutput:
    """What one request gained in one step, as the scheduler recorded it.

    `new_token_ids` stop at the first stop condition; `logprobs` holds one
    (token ids, logprobs) per new token for a request that asked. `finish_reason` is
    set once `finished` ("error" with `error` saying what failed).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    error: str | None = None


def check_runner_output(out: SchedulerOutput, result: ModelRunnerOutput) -> None:
    """Refuse a malformed runner output before any request state changes."""
    missing = set(out.num_scheduled_tokens) - set(result.req_ids)
    if missing or len(result.sampled_token_ids) != len(result.req_ids):
        raise ValueError(f"runner output lacks scheduled requests {sorted(missing)} or "
                         "has sampled_token_ids out of step with req_ids")
    for rid, drafts in result.draft_token_ids.items():
        limit = out.num_draft_tokens.get(rid, 0)
        if len(drafts) > limit:
            raise ValueError(f"runner proposed {len(drafts)} drafts for {rid!r}; the "
                             f"step charged num_draft_tokens={limit}")
    unasked = (set(result.shadow_token_ids) - set(out.shadow_req_ids)
               if result.shadow_token_ids else ())
    if unasked:
        raise ValueError(f"runner returned shadow drafts for {sorted(unasked)}, which the "
                         "step did not ask for (shadow_req_ids)")
