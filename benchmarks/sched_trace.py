"""A seeded serving trace, and the one replay loop both sides of the scheduler
side-by-side run it through (benchmarks/scheduler_vs_vllm.py).

Pure stdlib + numpy on purpose: vLLM's venv (benchmarks/vllm_sched_driver.py) imports
this file too, and must not import our packages.

The trace (issue 11): a burst of N requests at step 0, then Poisson arrivals at
`arrival_factor` times the rate at which N running requests drain, so the running set
stays full; lognormal prompts of ~100 tokens; 1 % of requests start a few tokens short
of `max_model_len` and run into it; a quarter open with one of a few 64-token prefixes
(4 blocks of 16, so prefix caching hits); each request accepts drafts at its own rate
in [0.3, 0.9].

The "model" is a pure function of the trace, so both schedulers see the same outcomes
whatever they decide: the draft for output position p is accepted iff a hash of
(request seed, p) falls under the request's acceptance rate, and the token at position
p is another such hash. A step that verifies s drafts from position p accepts the
leading run of accepted positions, at most s, then emits one more token.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

MASK64 = (1 << 64) - 1
FIRST_TOKEN_ID = 100  # ids below this are left to special tokens; none is ever emitted
T = TypeVar("T")


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a stable integer hash, the same in every Python/numpy."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class TraceConfig:
    """What the trace looks like; the engine limits derive from it (see `Trace`)."""

    num_running: int  # N: max_num_seqs, and the running set the arrivals keep full
    seed: int = 0
    num_requests: int = 0  # 0: 4 N
    max_model_len: int = 2048
    block_size: int = 16
    num_spec_tokens: int = 4  # K
    tokens_per_running: int = 16  # B = 16 N
    kv_tokens_per_running: int = 512  # KV pool: room for ~2.5x the mean request each
    prompt_median: int = 100
    output_median: int = 96
    length_sigma: float = 0.5
    prefix_share: float = 0.25
    prefix_len: int = 64
    long_share: float = 0.01
    acceptance: tuple[float, float] = (0.3, 0.9)
    arrival_factor: float = 1.25
    vocab_size: int = 32000


@dataclass(frozen=True)
class TraceRequest:
    """One request and its model behaviour (see the module docstring)."""

    request_id: str
    arrival_step: int
    prompt_token_ids: list[int]
    max_tokens: int
    acceptance: float
    seed: int
    vocab_size: int

    def token_id(self, position: int) -> int:
        span = self.vocab_size - FIRST_TOKEN_ID
        return FIRST_TOKEN_ID + _mix64(_mix64(self.seed) + 2 * position) % span

    def accepts(self, position: int) -> bool:
        """Whether a draft for output position `position` is accepted."""
        return (_mix64(_mix64(self.seed) + 2 * position + 1) >> 11) / (1 << 53) \
            < self.acceptance

    def emitted(self, num_output: int, num_verified: int) -> list[int]:
        """Tokens a step emits for a request holding `num_output` outputs that
        verifies `num_verified` drafts: the accepted ones, then one bonus/recovered."""
        accepted = 0
        while accepted < num_verified and self.accepts(num_output + accepted):
            accepted += 1
        return [self.token_id(num_output + i) for i in range(accepted + 1)]

    def priority(self) -> int:
        """Its priority under the priority policy (lower first): 0-3, from its seed, so
        the trace's JSON and fingerprint do not change."""
        return self.seed % 4

    def drafts(self, num_output: int, k: int) -> list[int]:
        """k drafts for the positions after `num_output` (their values never matter:
        `accepts` alone decides)."""
        return [self.token_id(num_output + i) for i in range(k)]


@dataclass(frozen=True)
class Trace:
    """The requests, sorted by arrival, and the engine limits both sides use."""

    config: TraceConfig
    requests: list[TraceRequest]

    @property
    def max_num_seqs(self) -> int:
        return self.config.num_running

    @property
    def max_num_batched_tokens(self) -> int:
        return self.config.tokens_per_running * self.config.num_running

    @property
    def num_blocks(self) -> int:
        return self.config.num_running * self.config.kv_tokens_per_running \
            // self.config.block_size

    def to_json(self) -> str:
        return json.dumps({"config": asdict(self.config),
                           "requests": [asdict(r) for r in self.requests]},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Trace:
        data = json.loads(text)
        config = data["config"]
        config["acceptance"] = tuple(config["acceptance"])
        return cls(TraceConfig(**config), [TraceRequest(**r) for r in data["requests"]])

    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def save(self, path: Path) -> None:
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> Trace:
        return cls.from_json(Path(path).read_text())


def _lognormal(rng: np.random.Generator, median: int, sigma: float, size: int,
               low: int, high: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, size)), low, high) \
        .astype(np.int64)


def _arrival_steps(rng: np.random.Generator, cfg: TraceConfig, num: int) -> np.ndarray:
    """Burst of N at step 0, then Poisson arrivals above the drain rate.

    Drain rate: N running requests each need ~1 + output / E[tokens per step] steps,
    with E = (1 - a^(K+1)) / (1 - a) at acceptance a (speculation on, the fastest
    drain, so the queue also grows with speculation off)."""
    a = np.linspace(*cfg.acceptance, 64)
    per_step = float(np.mean((1 - a ** (cfg.num_spec_tokens + 1)) / (1 - a)))
    steps_per_request = 1 + cfg.output_median * math.exp(cfg.length_sigma ** 2 / 2) / per_step
    rate = cfg.arrival_factor * cfg.num_running / steps_per_request
    burst = min(cfg.num_running, num)
    later = np.cumsum(rng.exponential(1 / rate, num - burst))
    return np.concatenate([np.zeros(burst, dtype=np.int64), 1 + later.astype(np.int64)])


def make_trace(cfg: TraceConfig) -> Trace:
    """The trace for `cfg`; the same config always gives the same trace."""
    rng = np.random.default_rng(cfg.seed)
    num = cfg.num_requests or 4 * cfg.num_running
    prompt_len = _lognormal(rng, cfg.prompt_median, cfg.length_sigma, num, 8, 1024)
    max_tokens = _lognormal(rng, cfg.output_median, cfg.length_sigma, num, 4,
                            4 * cfg.output_median)
    order = rng.permutation(num)
    num_long = max(1, round(cfg.long_share * num))
    long_ids = set(order[:num_long].tolist())
    shared_ids = order[num_long:num_long + round(cfg.prefix_share * num)].tolist()
    num_prefixes = max(1, len(shared_ids) // 8)  # each prefix is reused ~8 times
    prefixes = rng.integers(FIRST_TOKEN_ID, cfg.vocab_size, (num_prefixes, cfg.prefix_len))
    prefix_of = {i: int(rng.integers(num_prefixes)) for i in shared_ids}
    acceptance = rng.uniform(*cfg.acceptance, num)
    seeds = rng.integers(0, 1 << 62, num)
    arrivals = _arrival_steps(rng, cfg, num)
    requests = []
    for i in range(num):
        length, out = int(prompt_len[i]), int(max_tokens[i])
        if i in long_ids:  # starts 16-64 tokens short of max_model_len and runs into it
            length, out = cfg.max_model_len - int(rng.integers(16, 65)), cfg.max_model_len
        if i in prefix_of:
            length = max(length, cfg.prefix_len + 8)
        prompt = rng.integers(FIRST_TOKEN_ID, cfg.vocab_size, length)
        if i in prefix_of:
            prompt[:cfg.prefix_len] = prefixes[prefix_of[i]]
        requests.append(TraceRequest(f"req-{i}", int(arrivals[i]), prompt.tolist(), out,
                                     round(float(acceptance[i]), 4), int(seeds[i]),
                                     cfg.vocab_size))
    return Trace(cfg, requests)


# ---- the replay loop both sides share ----------------------------------------------


@dataclass
class TimedStep:
    """One engine step as a side measured it (microseconds; rows as counted)."""

    schedule_us: float
    update_us: float
    draft_update_us: float  # vLLM's update_draft_token_ids; 0 for ours (in update)
    scheduled_tokens: int
    drafter_rows: int
    running: int


class Side(Protocol):
    """One scheduler driven step by step with the trace's model behaviour."""

    def add(self, request: TraceRequest) -> None: ...

    def step(self) -> TimedStep | None:
        """Run one engine step; None when nothing was scheduled."""

    def num_unfinished(self) -> int: ...


@dataclass
class OutputLog:
    """Every request's emitted tokens, so the two sides can be checked identical."""

    tokens: dict[str, list[int]] = field(default_factory=dict)

    def add(self, request_id: str, new_token_ids: list[int]) -> None:
        self.tokens.setdefault(request_id, []).extend(new_token_ids)

    def digest(self) -> str:
        text = ";".join(f"{rid}:{','.join(map(str, self.tokens[rid]))}"
                        for rid in sorted(self.tokens))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())


def replay(trace: Trace, side: Side, max_steps: int = 100_000,
           collector: bool = True) -> list[TimedStep]:
    """Feed arrivals by step and step until every request finished.

    The trace clock advances one per step that scheduled work, so both sides see an
    arrival after the same number of executed steps; an idle engine jumps to the next
    arrival. `collector=False` turns Python's cyclic garbage collector off for the
    replay (its passes grow with the heap, hence with N)."""
    gc.collect()  # start without the trace's garbage
    if not collector:
        gc.disable()
    try:
        return _replay(trace, side, max_steps)
    finally:
        gc.enable()


def _replay(trace: Trace, side: Side, max_steps: int) -> list[TimedStep]:
    pending = sorted(trace.requests, key=lambda r: r.arrival_step)
    records: list[TimedStep] = []
    clock, next_req = 0, 0
    while next_req < len(pending) or side.num_unfinished():
        while next_req < len(pending) and pending[next_req].arrival_step <= clock:
            side.add(pending[next_req])
            next_req += 1
        if not side.num_unfinished():
            clock = pending[next_req].arrival_step
            continue
        record = side.step()
        if record is None:
            raise RuntimeError(f"nothing scheduled with {side.num_unfinished()} requests "
                               f"unfinished at step {len(records)}")
        records.append(record)
        clock += 1
        if len(records) > max_steps:
            raise RuntimeError(f"trace did not drain in {max_steps} steps")
    return records


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """(result, microseconds) of one call."""
    t0 = time.perf_counter_ns()
    result = fn(*args)
    return result, (time.perf_counter_ns() - t0) / 1000


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": 0.0, "p10": 0.0, "p90": 0.0}
    deciles = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
    return {"median": round(statistics.median(values), 1), "p10": round(deciles[0], 1),
            "p90": round(deciles[-1], 1)}


def curve(values: list[int], points: int = 100) -> list[int]:
    """At most `points` evenly spaced samples, first and last kept."""
    if len(values) <= points:
        return list(values)
    return [values[round(i * (len(values) - 1) / (points - 1))] for i in range(points)]


def summarize(trace: Trace, records: list[TimedStep], log: OutputLog) -> dict:
    """What the side-by-side reports for one side on one trace.

    Steady steps are those with at least 90 % of N running: the µs per step "at N
    running" the issue asks for; `all` covers the whole drain, burst and tail."""
    step_us = [r.schedule_us + r.update_us for r in records]
    is_steady = [r.running >= 0.9 * trace.max_num_seqs for r in records]
    steady = [us for us, keep in zip(step_us, is_steady, strict=True) if keep]
    # The same steps, with vLLM's separate draft update added (0 for ours).
    with_drafts = [us + r.draft_update_us
                   for us, r, keep in zip(step_us, records, is_steady, strict=True)
                   if keep or not steady]
    steps = len(records)
    return {
        "us_per_step": _spread(steady or step_us),
        "us_per_step_all": _spread(step_us),
        "steady_steps": len(steady),
        "schedule_us": _spread([r.schedule_us for r in records]),
        "update_us": _spread([r.update_us for r in records]),
        "draft_update_us": _spread([r.draft_update_us for r in records]),
        "us_per_step_with_draft_update": _spread(with_drafts),
        "total_ms": round(sum(step_us) / 1000, 2),
        "steps_to_drain": steps,
        "tokens_per_step": round(sum(r.scheduled_tokens for r in records) / steps, 2),
        "drafter_rows_per_step": round(sum(r.drafter_rows for r in records) / steps, 2),
        "max_drafter_rows": max(r.drafter_rows for r in records),
        "output_tokens": log.num_tokens,
        "output_tokens_per_step": round(log.num_tokens / steps, 2),
        "outputs_digest": log.digest(),
        "mean_running": round(statistics.mean(r.running for r in records), 1),
        "running_curve": curve([r.running for r in records]),
    }
