"""From the engine core's token updates to per-request text deltas and final outputs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from scheduler import EngineCoreOutput, SamplingParams

if TYPE_CHECKING:
    from engine.ipc import TokenUpdate

Logprobs = tuple[list[int], list[float]]  # sampled token first, then the top n


@dataclass
class RequestDelta:
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[Logprobs] = field(default_factory=list)
    error: str | None = None  # finish_reason "error": what failed


@dataclass
class _Tracked:
    detok: IncrementalDetokenizer
    num_prompt_tokens: int
    arrival: float
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class LatencySample:
    """Per-request timings for the metrics (seconds)."""

    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    # Mean time per output token after the first, set when a request finishes.
    tpot: float | None = None


class OutputProcessor:
    """Detokenizes, applies stop strings (asking the caller to abort those requests),
    and measures TTFT / inter-token / end-to-end latency."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._reqs: dict[str, _Tracked] = {}

    def add(self, request_id: str, num_prompt_tokens: int, params: SamplingParams) -> None:
        self._reqs[request_id] = _Tracked(IncrementalDetokenizer(self.tokenizer, params.stop),
                                          num_prompt_tokens, time.monotonic())

    def drop(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def abort(self, request_id: str) -> RequestDelta | None:
        """The final delta of a request aborted by its caller (None if unknown)."""
        tracked = self._reqs.pop(request_id, None)
        if tracked is None:
            return None
        return RequestDelta(request_id, [], tracked.detok.take(final=True), True, "abort",
                            tracked.num_prompt_tokens, len(tracked.detok.token_ids))

    def process(self, updates: Sequence[EngineCoreOutput | TokenUpdate]
                ) -> tuple[list[RequestDelta], list[str], dict[str, LatencySample]]:
        """Deltas, ids stopped by a stop string (to abort), latency samples."""
        deltas, to_abort, latency = [], [], {}
        now = time.monotonic()
        for update in updates:
            tracked = self._reqs.get(update.request_id)
            if tracked is None:
                continue
            sample = LatencySample()
            if update.new_token_ids:
                if tracked.first_token is None:
                    tracked.first_token = now
                    sample.ttft = now - tracked.arrival
                elif tracked.last_token is not None:
                    sample.itl = [(now - tracked.last_token) / len(update.new_token_ids)] * len(
                        update.new_token_ids)
                tracked.last_token = now
            finished, reason = update.finished, update.finish_reason
            new_ids, logprobs = update.new_token_ids, update.logprobs
            taken = tracked.detok.push(new_ids)
            if taken is not None:  # a stop string: it wins, as it would token by token
                if not finished:
                    to_abort.append(update.request_id)
                finished, reason = True, "stop"
                new_ids, logprobs = new_ids[:taken], logprobs[:taken]
            if finished:
                sample.e2e = now - tracked.arrival
                num_output = len(tracked.detok.token_ids)
                if tracked.first_token is not None and num_output > 1:
                    sample.tpot = (now - tracked.first_token) / (num_output - 1)
                del self._reqs[update.request_id]
            latency[update.request_id] = sample
            deltas.append(RequestDelta(
                update.request_id, new_ids, tracked.detok.take(final=finished),
                finished, reason, tracked.num_prompt_tokens, len(tracked.detok.token_ids),
                logprobs, update.error))
        return deltas, to_abort, latency
