"""A model-free runner for simulations, benchmarks and scheduler tests.

It runs the real runner's checks (runner/invariant.py) and builds every drafter pass
with the same assembly code (spec_decode/passes.py), so a scheduler bug that the model
runner would refuse is refused here too, without a model. Tokens come from a seeded
generator: each draft is accepted with probability `acceptance` (and a parked request
samples the draft it was asked to shadow, `SchedulerOutput.shadow_req_ids`, with that
probability too), and `eos_prob` ends a request early.

It is built for one scheduler and holds that scheduler's limits (B, max_model_len, K,
block size), as the model runner holds its own: it re-derives the k rule, bounds every
row inside its request's KV slots and checks each pass against its own B, never
against what a SchedulerOutput declares.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from runner.invariant import StepFacts, check_filled, check_step
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from spec_decode.passes import StepResult, StepRows, fill_pass, sequential_positions

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler

@dataclass
class _ReqState:
    num_tokens: int  # known tokens the runner holds (prompt + outputs)
    num_computed: int
    num_prompt: int
    max_tokens: int
    num_blocks: int
    num_drafter_computed: int  # positions its drafter holds (below c while parked)
    shadow: int | None = None  # the draft it would have proposed while parked


@dataclass
class BuiltStep:
    """The positions of every pass of one step, by pass name."""

    passes: dict[str, np.ndarray] = field(default_factory=dict)

    def max_position(self) -> int:
        return max((int(p.max()) for p in self.passes.values() if p.size), default=-1)


class SimulatedRunner:
    """Executes SchedulerOutputs without a model; see the module docstring."""

    def __init__(self, scheduler: Scheduler, vocab_size: int = 1000, acceptance: float = 0.6,
                 eos_token_id: int | None = None, eos_prob: float = 0.0, seed: int = 0,
                 propose: Callable[[str, int], list[int]] | None = None,
                 step_time: Callable[[dict[str, int]], float] | None = None) -> None:
        """A runner for `scheduler`'s configs (read once: B, max_model_len, K and the
        block size are the limits it checks every step against). `step_time`: the
        seconds a step "takes" given the rows it built per pass, reported as
        `ModelRunnerOutput.step_seconds` (a deterministic stand-in for a clock)."""
        spec = scheduler.speculative_config
        self.method = spec.spec_method if spec else None
        self.vocab_size = vocab_size
        self.acceptance = acceptance
        self.eos_token_id = eos_token_id
        self.eos_prob = eos_prob
        self.rng = random.Random(seed)
        self.propose = propose or self._random_drafts
        self.step_time = step_time
        self.max_model_len = scheduler.config.max_model_len
        self.max_k = spec.num_speculative_tokens if spec else 0
        self.parks = bool(spec and spec.parks)
        self.block_size = scheduler.cache_config.block_size
        self.max_num_batched_tokens = scheduler.config.max_num_batched_tokens
        self.reqs: dict[str, _ReqState] = {}
        self.last_step: BuiltStep | None = None

    def _random_drafts(self, rid: str, k: int) -> list[int]:
        return [self.rng.randrange(self.vocab_size) for _ in range(k)]

    def _facts(self, out: SchedulerOutput, req_ids: list[str]) -> StepFacts:
        """Each request's counters before the step, as `ModelRunner._step_facts`."""
        new = {data.req_id: data for data in out.scheduled_new_reqs}
        new_blocks = out.scheduled_cached_reqs.num_new_blocks()
        columns = []
        for rid in req_ids:
            if rid in new:
                data = new[rid]
                prompt = len(data.prompt_token_ids)
                columns.append((prompt + len(data.output_token_ids), prompt,
                                data.num_computed_tokens, data.sampling_params.max_tokens,
                                len(data.block_ids), data.num_drafter_computed_tokens))
            else:
                st = self.reqs[rid]
                columns.append((st.num_tokens, st.num_prompt, st.num_computed, st.max_tokens,
                                st.num_blocks + new_blocks.get(rid, 0), st.num_drafter_computed))
        arr = np.array(columns, dtype=np.int64).reshape(len(req_ids), 6)
        spec = out.scheduled_spec_decode_tokens
        s = np.array([len(spec.get(rid, ())) for rid in req_ids], dtype=np.int64)
        slots = arr[:, 4] * self.block_size
        return StepFacts(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], s, slots, arr[:, 5])

    def _sync(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in out.scheduled_new_reqs:
            prompt = len(new.prompt_token_ids)
            self.reqs[new.req_id] = _ReqState(
                prompt + len(new.output_token_ids), new.num_computed_tokens, prompt,
                new.sampling_params.max_tokens, len(new.block_ids),
                new.num_drafter_computed_tokens)
        cached = out.scheduled_cached_reqs
        for rid, block_ids, computed in zip(cached.req_ids, cached.new_block_ids,
                                            cached.num_computed_tokens):
            state = self.reqs[rid]
            state.num_computed = computed
            state.num_blocks += len(block_ids)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        n = np.fromiter(out.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        k = np.array([out.num_draft_tokens.get(r, 0) for r in req_ids], dtype=np.int64)
        facts = self._facts(out, req_ids)
        planned = check_step(self.method, out, req_ids, n, k, facts, self.max_k,
                             self.max_model_len, self.max_num_batched_tokens, self.parks)
        self._sync(out)
        sampled: list[list[int]] = []
        drafts: dict[str, list[int]] = {}
        shadows: dict[str, int] = {}
        shadowed = set(out.shadow_req_ids)
        valid = n.copy()
        parked = planned.parked if planned.parked is not None else np.zeros(len(n), dtype=bool)
        for i, rid in enumerate(req_ids):
            state = self.reqs[rid]
            verified = int(facts.num_spec[i])
            if state.num_computed + n[i] < state.num_tokens:
                sampled.append([])  # a prefill chunk that stops short of sampling
                state.num_computed += int(n[i])
            else:
                tokens = self._verify(out.scheduled_spec_decode_tokens.get(rid, []),
                                      state.shadow)
                state.shadow = None
                sampled.append(tokens)
                valid[i] = n[i] - verified + len(tokens) - 1
                state.num_computed += int(valid[i])
                state.num_tokens += len(tokens)
                if k[i]:
                    drafts[rid] = self.propose(rid, int(k[i]))[:int(k[i])]
                elif rid in shadowed:
                    shadow = self.propose(rid, 1)[:1]  # a lookup may find nothing
                    if shadow:
                        shadows[rid] = state.shadow = shadow[0]
            if not parked[i]:
                state.num_drafter_computed = state.num_computed
        self.last_step = self._build(planned, facts, n, k, valid,
                                     np.array([bool(t) for t in sampled], dtype=bool))
        seconds = self.step_time(planned.counts) if self.step_time else None
        return ModelRunnerOutput(req_ids, sampled, drafts, pass_rows=planned.counts,
                                 step_seconds=seconds, shadow_token_ids=shadows)

    def _build(self, planned: StepRows, facts: StepFacts, n: np.ndarray, k: np.ndarray,
               valid: np.ndarray, samples: np.ndarray) -> BuiltStep:
        """Every pass's rows, filled as the model runner fills them, and checked."""
        c = facts.num_computed
        starts = np.cumsum(n) - n
        catch_up = planned.catch_up if planned.catch_up is not None else np.zeros_like(c)
        res = StepResult(np.arange(len(n)), c, n, starts, valid, samples,
                         np.where(samples, k, 0), catch_up)
        step = BuiltStep({"target": np.repeat(c - starts, n) + np.arange(int(n.sum()))})
        method = self.method
        if method is None:
            return step
        for rows in planned.passes:
            draft_pass = fill_pass(rows, res, None, 0)
            check_filled(method.name, draft_pass, res.q_start, n, c)
            step.passes[draft_pass.name] = draft_pass.positions
        if method.sequential:
            for j in range(1, int(res.num_draft_tokens.max(initial=0))):
                reqs = np.flatnonzero(res.num_draft_tokens > j)
                step.passes[f"step_{j}"] = sequential_positions(method, res, j)[reqs]
        return step

    def _verify(self, spec: list[int], shadow: int | None = None) -> list[int]:
        """Accept drafts left to right until a rejection; always add one token (with no
        draft, the `shadow` draft with the chance a draft is accepted)."""
        if not spec and shadow is not None and self.rng.random() < self.acceptance:
            return [shadow]
        accepted = []
        for token in spec:
            if self.rng.random() >= self.acceptance:
                break
            accepted.append(token)
        if self.eos_token_id is not None and self.rng.random() < self.eos_prob:
            return [*accepted, self.eos_token_id]
        return [*accepted, self.rng.randrange(self.vocab_size)]
