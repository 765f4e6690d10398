"""What one step's sampled tokens do to one request: pure per-request rules that
`Scheduler.update_from_output` applies to every scheduled request, in the order
`in_schedule_order` gives."""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus


def count_accepted(request: Request, sampled: list[int], verified: int) -> int:
    """Drafts accepted: all sampled tokens but the last (the bonus or recovered one).
    Refuses a runner output that sampled more than the drafts verified allow."""
    if not sampled:
        if verified:
            raise ValueError(f"{request.request_id!r} verified drafts but sampled nothing")
        return 0
    accepted = len(sampled) - 1
    if accepted > verified:
        raise ValueError(
            f"{request.request_id!r}: {len(sampled)} tokens sampled from "
            f"{verified} drafts (at most {verified + 1})"
        )
    return accepted


def append_tokens(request: Request, sampled: list[int], max_model_len: int) -> RequestStatus | None:
    """Append the step's tokens; the first stop condition drops the rest.

    Most steps end no request: if no sampled token is a stop token and the request
    stays short of both length limits after all of them, every token is appended at
    once. Otherwise they go one by one, so a stop inside the accepted drafts cuts
    exactly there.
    """
    params = request.sampling_params
    if (len(request.output_token_ids) + len(sampled) < params.max_tokens
            and len(request.all_token_ids) + len(sampled) < max_model_len
            and (params.ignore_eos or request.eos_token_id not in sampled)
            and not (params.stop_token_ids and any(t in params.stop_token_ids for t in sampled))):
        request.output_token_ids += sampled
        request.all_token_ids += sampled
        return None
    return _append_one_by_one(request, sampled, max_model_len)


def _append_one_by_one(request: Request, sampled: list[int],
                       max_model_len: int) -> RequestStatus | None:
    params = request.sampling_params
    for token in sampled:
        request.append_output_token(token)
        if request.num_output_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_token_id = token
                return RequestStatus.FINISHED_STOPPED
        if (request.num_output_tokens >= params.max_tokens
                or request.num_tokens >= max_model_len):
            return RequestStatus.FINISHED_LENGTH
    return None


def check_shadow(request: Request, token: int) -> int:
    """1 if `token`, the first a parked request sampled, is the draft it would have
    proposed (`SchedulerOutput.shadow_req_ids`), else 0; counted in its record as one
    verified draft. A lookup draft is one token for certain, so the target accepts it
    with the chance it samples it (greedy: when it is the argmax), and a sampled token
    equal to it is that chance, drawn once. The request's own record and state learn
    from it as from a verification; the policy's per-state rates do not: parked
    requests are the ones the policy rated low, and pooled into the rates that price
    every request their checks moved those rates (measured at 16 running, ngram on
    held-out chat, side by side: 0.979x speculation off pooled, 0.987x not; 4 running
    alike)."""
    hit = int(token == request.shadow_token_id)
    request.shadow_token_id = None
    request.record_verification(1, hit)
    return hit


def in_schedule_order(out: SchedulerOutput,
                      result: ModelRunnerOutput) -> Iterable[tuple[str, list[int]]]:
    """(request id, sampled tokens) in the schedule's order, whatever the runner's."""
    if len(result.req_ids) == len(out.num_scheduled_tokens) and \
            result.req_ids == list(out.num_scheduled_tokens):
        return zip(result.req_ids, result.sampled_token_ids)
    index = {rid: i for i, rid in enumerate(result.req_ids)}
    return ((rid, result.sampled_token_ids[index[rid]]) for rid in out.num_scheduled_tokens)
