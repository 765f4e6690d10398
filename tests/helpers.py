"""Small builders shared by the scheduler tests, and markers shared across test files."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from runner.models.linear import LinearKernel, OneDNNLinear, TorchLinear
from runner.simulated import SimulatedRunner
from scheduler import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.config import GoodputSettings
from spec_decode import SpeculativeConfig
from spec_decode.methods import get_method

# Without a C compiler the CPU attention kernel cannot be built (the torch path serves,
# which tests/runner/test_cpu_attention.py checks); with one, a kernel that fails to
# build fails the tests so marked.
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler on PATH: the CPU attention kernel cannot be built here")


def make_scheduler(method: str | None = None, k: int = 4, budget: int = 64,
                   max_num_seqs: int = 16, max_model_len: int = 256, block_size: int = 4,
                   num_blocks: int = 256, draft_policy: str = "fixed",
                   goodput: GoodputSettings | None = None,
                   **kwargs: object) -> Scheduler:
    spec = SpeculativeConfig(method, k, draft_policy=draft_policy) if method else None
    sched_kwargs = {key: v for key, v in kwargs.items() if key != "enable_prefix_caching"}
    return Scheduler(
        SchedulerConfig(budget, max_num_seqs, max_model_len, **sched_kwargs),  # type: ignore[arg-type]
        CacheConfig(block_size=block_size, num_blocks=num_blocks,
                    enable_prefix_caching=bool(kwargs.get("enable_prefix_caching", True))),
        spec, goodput=goodput,
    )


def make_request(rid: str, prompt_len: int, max_tokens: int = 16, first_token: int = 10,
                 **params: object) -> Request:
    prompt = [first_token + (i % 500) for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
                   eos_token_id=2)


def run_step(scheduler: Scheduler, runner: SimulatedRunner):  # type: ignore[no-untyped-def]
    out = scheduler.schedule()
    result = runner.execute(out)
    scheduler.update_from_output(out, result)
    return out, result


def drain(scheduler: Scheduler, runner: SimulatedRunner, max_steps: int = 10_000) -> int:
    steps = 0
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)
        scheduler.kv.pool.check_integrity()
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def spec_dict(method: str | None, k: int, **options: object) -> dict | None:
    """A speculative config for the real runner; head methods get an untrained head by
    name ("model": "random"), since CI has no trained head (and a missing one is
    refused)."""
    if method is None:
        return None
    spec: dict = {"method": method, "num_speculative_tokens": k, **options}
    if get_method(method).drafter == "head":
        spec.setdefault("model", "random")
    return spec


def kernel_that_packs(dtype: torch.dtype) -> LinearKernel:
    """oneDNN where it packs `dtype` on this CPU, else `F.linear`: oneDNN's bfloat16
    path needs AVX-512 (or AVX-NE-CONVERT), which an AVX2 EPYC lacks (2026-12-07)."""
    try:
        OneDNNLinear().pack(torch.zeros(8, 16, dtype=dtype), None)
    except RuntimeError:
        return TorchLinear()
    return OneDNNLinear()
