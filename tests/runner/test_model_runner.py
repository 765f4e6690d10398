"""ModelRunner on the real default model: buffers, invariant, equivalence of batching."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.tokenizer import Tokenizer
from runner import BudgetInvariantError
from runner.config import RunnerConfig, kv_bytes_per_block
from runner.model_loader import load_model
from runner.model_prep import resolve_model
from runner.model_runner import ModelRunner
from runner.models.llama import LlamaForCausalLM
from scheduler import (
    CacheConfig,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from scheduler.config import GoodputSettings
from spec_decode import SpeculativeConfig
from spec_decode.ngram import NgramProposer

pytestmark = pytest.mark.model  # loads the real default model

BLOCK = 16


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return load_model(resolve_model(None), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model(None))


def make_engine(model: LlamaForCausalLM, budget: int = 256, max_num_seqs: int = 8,
                prefix_caching: bool = True, num_blocks: int = 64,
                device: str = "cpu") -> tuple[Scheduler, ModelRunner]:
    sched_cfg = SchedulerConfig(budget, max_num_seqs, 512)
    runner = ModelRunner(RunnerConfig(device=device), sched_cfg, BLOCK, model=model)
    runner.initialize_kv_cache(num_blocks)
    sched = Scheduler(sched_cfg, CacheConfig(BLOCK, num_blocks, prefix_caching))
    return sched, runner


def generate(sched: Scheduler, runner: ModelRunner, prompts: dict[str, list[int]],
             params: SamplingParams, stagger: bool = False) -> dict[str, list[int]]:
    """Run to completion; `stagger` adds one request per step (mixed prefill/decode)."""
    reqs = {rid: Request(rid, ids, params, eos_token_id=None) for rid, ids in prompts.items()}
    pending = list(reqs.values())
    if not stagger:
        for req in pending:
            sched.add_request(req)
        pending = []
    while pending or sched.has_unfinished_requests():
        if pending:
            sched.add_request(pending.pop(0))
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert sched.kv_cache_usage() == 0.0
    return {rid: req.output_token_ids for rid, req in reqs.items()}


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are red, yellow and",
]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Tokenizer) -> dict[str, list[int]]:
    return {f"p{i}": tokenizer.encode(text) for i, text in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def solo(model: LlamaForCausalLM, prompt_ids: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each prompt alone, whole prefill, greedy: the reference tokens."""
    params = SamplingParams(max_tokens=6)
    result = {}
    for rid, ids in prompt_ids.items():
        sched, runner = make_engine(model, prefix_caching=False)
        result.update(generate(sched, runner, {rid: ids}, params))
    return result


def test_greedy_paris(solo: dict[str, list[int]], tokenizer: Tokenizer) -> None:
    assert "Paris" in tokenizer.decode(solo["p0"])


def test_batched_matches_solo(model: LlamaForCausalLM, prompt_ids: dict[str, list[int]],
                              solo: dict[str, list[int]]) -> None:
    sched, runner = make_engine(model, prefix_caching=False)
    assert generate(sched, runner, prompt_ids, SamplingParams(max_tokens=6),
                    stagger=True) == solo


def test_chunked_prefill_matches_solo(model: LlamaForCausalLM,
                                      prompt_ids: dict[str, list[int]],
                                      solo: dict[str, list[int]]) -> None:
    """B=8: every prompt is split into chunks, mixed with other requests' decodes."""
    sched, runner = make_engine(model, budget=8, prefix_caching=False)
    assert generate(sched, runner, prompt_ids, SamplingParams(max_tokens=6)) == solo


def test_prefix_cached_matches_solo(model: LlamaForCausalLM, tokenizer: Tokenizer) -> None:
    """A second request sharing a 2-block prefix reads the first one's cached KV."""
    shared = tokenizer.encode("Q: What is the tallest mountain in the world? " * 4)[:2 * BLOCK]
    a = shared + tokenizer.encode(" Answer briefly. A:")
    b = shared + tokenizer.encode(" Reply in one word. A:")
    params = SamplingParams(max_tokens=5)
    expected = {}
    for rid, ids in (("a", a), ("b", b)):
        sched, runner = make_engine(model, prefix_caching=False)
        expected.update(generate(sched, runner, {rid: ids}, params))
    sched, runner = make_engine(model)
    got = generate(sched, runner, {"a": a}, params)
    got.update(generate(sched, runner, {"b": b}, params))
    assert sched.stats.num_prefix_hit_tokens == 2 * BLOCK
    assert got == expected


def test_seeded_sampling_independent_of_batch(model: LlamaForCausalLM,
                                              prompt_ids: dict[str, list[int]]) -> None:
    seeded = SamplingParams(max_tokens=5, temperature=0.9, top_p=0.95, seed=1234)
    sched, runner = make_engine(model)
    alone = generate(sched, runner, {"p1": prompt_ids["p1"]}, seeded)["p1"]
    sched, runner = make_engine(model)
    reqs = {rid: Request(rid, ids, seeded if rid == "p1" else
                         SamplingParams(max_tokens=5, temperature=1.0))
            for rid, ids in prompt_ids.items()}
    for req in reqs.values():
        sched.add_request(req)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert reqs["p1"].output_token_ids == alone


def test_buffers_fixed_and_same_with_spec_on(model: LlamaForCausalLM,
                                             prompt_ids: dict[str, list[int]]) -> None:
    sched_cfg = SchedulerConfig(64, 8, 512)
    off = ModelRunner(RunnerConfig(), sched_cfg, BLOCK, model=model)
    on = ModelRunner(RunnerConfig(), sched_cfg, BLOCK,
                     SpeculativeConfig("dflash", 4, model="random"), model=model)
    assert off.persistent_buffer_bytes == on.persistent_buffer_bytes
    # Sized by B and max_num_seqs: B rows for the flat token buffers.
    assert off.buffers.input_ids.cpu.shape == (64,)
    assert off.buffers.seq_lens.cpu.shape == (8,)
    sched, runner = make_engine(model, budget=16)
    ptrs = [b.cpu.data_ptr() for b in runner.buffers.all()]
    generate(sched, runner, prompt_ids, SamplingParams(max_tokens=3))
    assert [b.cpu.data_ptr() for b in runner.buffers.all()] == ptrs


def test_the_runner_times_its_drafter_apart(model: LlamaForCausalLM,
                                            prompt_ids: dict[str, list[int]]) -> None:
    """Each step reports its wall time and, with speculation on, the share its drafter
    took (the goodput policy's time model fits the two apart); none with it off."""
    sched_cfg = SchedulerConfig(64, 8, 512)
    spec = SpeculativeConfig("dflash", 2, model="random")
    runner = ModelRunner(RunnerConfig(), sched_cfg, BLOCK, spec, model=model)
    runner.initialize_kv_cache(64)
    sched = Scheduler(sched_cfg, CacheConfig(BLOCK, 64, True), spec)
    off_sched, off_runner = make_engine(model)
    for rid, ids in prompt_ids.items():
        sched.add_request(Request(rid, ids, SamplingParams(max_tokens=4)))
        off_sched.add_request(Request(rid, ids, SamplingParams(max_tokens=4)))
    drafted = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        result = runner.execute(out)
        assert result.step_seconds is not None and result.drafter_seconds is not None
        assert 0.0 < result.drafter_seconds < result.step_seconds
        drafted += bool(result.draft_token_ids)
        sched.update_from_output(out, result)
    assert drafted
    off_out = off_sched.schedule()
    assert off_runner.execute(off_out).drafter_seconds is None


def test_over_budget_output_raises_before_writing(model: LlamaForCausalLM) -> None:
    sched, runner = make_engine(model, budget=16)
    sched.add_request(Request("r", list(range(100, 112)), SamplingParams(max_tokens=2)))
    out = sched.schedule()
    runner.buffers.input_ids.np[:] = -7
    forged = dataclasses.replace(out, num_scheduled_tokens={"r": 20})
    with pytest.raises(BudgetInvariantError, match=r"'target' built 20 rows.*16"):
        runner.execute(forged)
    assert (runner.buffers.input_ids.np == -7).all()


def test_kv_blocks_from_memory_budget(model: LlamaForCausalLM) -> None:
    cfg = model.config
    per_block = kv_bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                   cfg.head_dim, BLOCK, torch.float32)
    assert per_block == 2 * 30 * BLOCK * 3 * 64 * 4
    runner = ModelRunner(RunnerConfig(kv_cache_memory_bytes=10 * per_block + 5),
                         SchedulerConfig(64, 8, 512), BLOCK, model=model)
    assert runner.num_kv_blocks() == 10
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        ModelRunner(RunnerConfig(kv_cache_memory_bytes=per_block - 1),
                    SchedulerConfig(64, 8, 512), BLOCK, model=model).num_kv_blocks()


def test_empty_step(model: LlamaForCausalLM) -> None:
    sched, runner = make_engine(model)
    out: SchedulerOutput = sched.schedule()
    result = runner.execute(out)
    assert result.req_ids == [] and result.sampled_token_ids == []


@pytest.mark.gpu
def test_runner_on_cuda_matches_cpu_greedy(prompt_ids: dict[str, list[int]],
                                           solo: dict[str, list[int]]) -> None:
    cuda_model = load_model(resolve_model(None), torch.float32, torch.device("cuda"))
    sched, runner = make_engine(cuda_model, budget=32, device="cuda")
    got = generate(sched, runner, prompt_ids, SamplingParams(max_tokens=6))
    assert got == solo
    assert np.all(runner.buffers.input_ids.cpu.is_pinned())


def test_a_parked_requests_shadow_draft_is_ngrams_next_draft(
        model: LlamaForCausalLM, tokenizer: Tokenizer) -> None:
    """ngram under the goodput policy, which a prior of near-zero acceptance (and no
    optimism) parks: the runner proposes each parked request's draft all the same, as
    ngram would over the tokens it holds, and the target never verifies it (the tokens
    are those of speculation off); the scheduler checks each against the token sampled
    next, and only those checks can start it drafting (the prompts repeat)."""
    text = "one two three four, one two three four, one two three four, one two"
    ids = {"a": tokenizer.encode(text), "b": tokenizer.encode("1 2 3 1 2 3 1 2 3 1")}
    sched_cfg = SchedulerConfig(64, 8, 512)
    spec = SpeculativeConfig("ngram", 4, draft_policy="goodput")
    runner = ModelRunner(RunnerConfig(), sched_cfg, BLOCK, spec, model=model)
    runner.initialize_kv_cache(64)
    sched = Scheduler(sched_cfg, CacheConfig(BLOCK, 64, True), spec,
                      goodput=GoodputSettings(prior_acceptance=0.001, explore=0.0))
    params = SamplingParams(max_tokens=12)
    for rid, prompt in ids.items():
        sched.add_request(Request(rid, prompt, params, eos_token_id=None))
    proposer = NgramProposer()
    shadows, tokens, drafted = 0, {rid: [] for rid in ids}, False
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert not set(out.shadow_req_ids) & set(out.num_draft_tokens)
        if out.num_draft_tokens and not drafted:
            drafted = True
            assert sched.stats.goodput.shadow_hits > 0  # what started it drafting
        result = runner.execute(out)
        for got in sched.update_from_output(out, result):
            tokens[got.request_id] += got.new_token_ids
        for rid, token in result.shadow_token_ids.items():
            request = sched.requests.get(rid)
            if request is not None:
                known = np.array(request.all_token_ids)
                assert token == proposer.propose(rid, known, 1)[0]
                shadows += 1
    assert shadows >= 4 and sched.stats.goodput.shadow_checks >= 4
    assert drafted and sched.stats.spec.num_draft_tokens > 0
    off_sched, off_runner = make_engine(model)
    assert generate(off_sched, off_runner, ids, params) == tokens
