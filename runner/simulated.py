"""A model-free runner for simulations, benchmarks and scheduler tests.

It builds every forward pass a real runner would build, as explicit rows of
(request, position), from its own reading of DESIGN.md §1 (it never asks
`spec_decode.layout`), counts them, and asserts the budget invariant exactly as the
real runner does. Tokens come from a seeded generator: each draft is accepted with
probability `acceptance`, and `eos_prob` ends a request early.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from runner.invariant import check_pass_rows
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput

Row = tuple[str, int]  # (request id, position)


@dataclass
class _ReqState:
    num_tokens: int  # known tokens the runner holds (prompt + outputs)
    num_computed: int


@dataclass
class BuiltStep:
    """The rows of every pass of one step, by pass name."""

    passes: dict[str, list[Row]] = field(default_factory=dict)

    def add(self, name: str, rows: list[Row]) -> None:
        self.passes.setdefault(name, []).extend(rows)

    def counts(self) -> dict[str, int]:
        return {name: len(rows) for name, rows in self.passes.items()}


def _context(rid: str, start: int, n: int) -> list[Row]:
    return [(rid, pos) for pos in range(start, start + n)]


def _build_drafter(method: str, step: BuiltStep, rid: str, start: int, n: int, k: int) -> None:
    """Append one request's drafter rows; `start + n` is the bonus token's position."""
    end = start + n
    if method in ("eagle", "mtp"):
        step.add("draft", _context(rid, start, n))
    elif method == "draft_model":
        step.add("draft", _context(rid, start, n) + ([(rid, end)] if k else []))
    elif method == "parallel":
        step.add("draft", _context(rid, start, n) + _context(rid, end, max(k - 1, 0)))
    elif method == "pard":
        step.add("draft", _context(rid, start, n) + _context(rid, end, k))
    elif method == "dflash":
        step.add("context", _context(rid, start, n))
        step.add("query", _context(rid, end, k + 1) if k else [])
    if method in ("eagle", "mtp", "draft_model"):
        # Sequential drafting: step i holds one row for each request still drafting.
        for i in range(1, k):
            step.add(f"step_{i}", [(rid, end + i)])


class SimulatedRunner:
    """Executes SchedulerOutputs without a model; see the module docstring."""

    def __init__(self, method: str | None, vocab_size: int = 1000, acceptance: float = 0.6,
                 eos_token_id: int | None = None, eos_prob: float = 0.0, seed: int = 0,
                 propose: Callable[[str, int], list[int]] | None = None) -> None:
        self.method = method
        self.vocab_size = vocab_size
        self.acceptance = acceptance
        self.eos_token_id = eos_token_id
        self.eos_prob = eos_prob
        self.rng = random.Random(seed)
        self.propose = propose or self._random_drafts
        self.reqs: dict[str, _ReqState] = {}
        self.last_step: BuiltStep | None = None

    def _random_drafts(self, rid: str, k: int) -> list[int]:
        return [self.rng.randrange(self.vocab_size) for _ in range(k)]

    def _sync(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in out.scheduled_new_reqs:
            known = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.reqs[new.req_id] = _ReqState(known, new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            self.reqs[cached.req_id].num_computed = cached.num_computed_tokens

    def build(self, out: SchedulerOutput) -> BuiltStep:
        """Every pass's rows for this step (target, then the drafter's)."""
        step = BuiltStep({"target": []})
        for rid, n in out.num_scheduled_tokens.items():
            state = self.reqs[rid]
            step.add("target", _context(rid, state.num_computed, n))
            if self.method is not None:
                k = out.num_draft_tokens.get(rid, 0)
                _build_drafter(self.method, step, rid, state.num_computed, n, k)
        return step

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._sync(out)
        step = self.build(out)
        check_pass_rows(self.method, out.max_num_batched_tokens, step.counts(),
                        out.num_drafter_tokens)
        self.last_step = step
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        drafts: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            state = self.reqs[rid]
            req_ids.append(rid)
            verified = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            if state.num_computed + n < state.num_tokens:
                sampled.append([])  # a prefill chunk that stops short of sampling
                state.num_computed += n
                continue
            tokens = self._verify(out.scheduled_spec_decode_tokens.get(rid, []))
            sampled.append(tokens)
            state.num_computed += n - (verified - (len(tokens) - 1))
            state.num_tokens += len(tokens)
            k = out.num_draft_tokens.get(rid, 0)
            if k:
                drafts[rid] = self.propose(rid, k)[:k]
        return ModelRunnerOutput(req_ids, sampled, drafts, pass_rows=step.counts())

    def _verify(self, spec: list[int]) -> list[int]:
        """Accept drafts left to right until a rejection; always add one token."""
        accepted = []
        for token in spec:
            if self.rng.random() >= self.acceptance:
                break
            accepted.append(token)
        if self.eos_token_id is not None and self.rng.random() < self.eos_prob:
            return [*accepted, self.eos_token_id]
        return [*accepted, self.rng.randrange(self.vocab_size)]
