"""Speculative decoding end to end on the default model: lossless for every method."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from engine.llm import LLM
from runner.model_loader import load_model
from runner.model_prep import resolve_model
from runner.models.llama import LlamaForCausalLM
from scheduler import SamplingParams
from spec_decode import METHODS
from tests.helpers import spec_dict

pytestmark = pytest.mark.model  # loads the real default model

GROUNDED = [
    "Copy the list exactly: apple, banana, cherry, date, elderberry, fig, grape. "
    "Copy: apple, banana, cherry,",
    "def area(width, height):\n    return width * height\n\n"
    "def area(width, height):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30",
]
OPEN = [
    "The capital of France is",
    "Once upon a time, a curious robot",
    "Three tips for staying healthy are",
    "The best way to learn a new language is",
]
PROMPTS = (GROUNDED + OPEN) * 2
PARAMS = SamplingParams(max_tokens=10)
K = 3


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return load_model(resolve_model(None), torch.float32, torch.device("cpu"))


def run(model: LlamaForCausalLM, method: str | None, prompts: list[str],
        **kwargs: Any) -> tuple[list[list[int]], dict[str, Any]]:
    spec = spec_dict(method, K)
    if spec is not None and "draft_policy" in kwargs:
        spec["draft_policy"] = kwargs.pop("draft_policy")
    kwargs.pop("draft_policy", None)
    kwargs.setdefault("max_num_batched_tokens", 64)
    kwargs.setdefault("max_model_len", 256)
    llm = LLM(loaded_model=model, speculative_config=spec, max_num_seqs=16, **kwargs)
    outs = llm.generate(prompts, PARAMS)
    assert llm.engine.scheduler.kv_cache_usage() == 0.0
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics()


_baseline: dict[tuple[int, str], list[list[int]]] = {}


def baseline(model: LlamaForCausalLM, concurrency: int) -> list[list[int]]:
    """Speculation off, one request at a time, every prompt in chunks of 16 (B = 16):
    the reference tokens. The runs it is compared with use B = 64 (the first prompt,
    28 tokens, in one chunk), so even speculation off at concurrency 1 checks
    something: whole prompts against chunked ones."""
    key = (concurrency, "solo")
    if key not in _baseline:
        tokens = []
        for prompt in PROMPTS[:concurrency]:
            tokens += run(model, None, [prompt], max_num_batched_tokens=16)[0]
        _baseline[key] = tokens
    return _baseline[key]


@pytest.mark.parametrize("concurrency", [1, 4, 16])
@pytest.mark.parametrize("method", [None, *METHODS])
def test_greedy_lossless(model: LlamaForCausalLM, method: str | None,
                         concurrency: int) -> None:
    """B=64 forces chunked prefill (the grounded prompts are longer) and mixes decodes.
    Fixed K, so every method drafts (goodput rightly never drafts with draft_model,
    whose drafter is the whole target; tests/e2e/test_parking.py runs goodput's
    parked requests)."""
    tokens, metrics = run(model, method, PROMPTS[:concurrency], draft_policy="fixed")
    assert tokens == baseline(model, concurrency)
    assert all(rows <= 64 for rows in metrics["peak_pass_rows"].values())
    if method is not None and concurrency == 16:
        assert metrics["spec_decode"]["num_draft_tokens"] > 0


@pytest.mark.parametrize("method", [None, *METHODS])
def test_greedy_lossless_under_preemption(model: LlamaForCausalLM, method: str | None) -> None:
    """A KV pool far too small for 8 requests at once: preemption must occur."""
    tokens, metrics = run(model, method, PROMPTS[:8], num_kv_blocks=10,
                             max_model_len=128)
    assert metrics["num_preemptions"] > 0
    assert tokens == baseline(model, 16)[:8]


@pytest.fixture(scope="module")
def model_int8() -> LlamaForCausalLM:
    """Packed for int8 by the first engine built on it."""
    return load_model(resolve_model(None), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(("method", "concurrency"),
                         [("ngram", 1), ("eagle", 1), *((m, 16) for m in METHODS)])
def test_greedy_lossless_int8(model_int8: LlamaForCausalLM, method: str,
                              concurrency: int) -> None:
    """int8 weights: speculation on equals speculation off in int8, token for token
    (every method beside other requests; one-row decodes against verification alone
    for a lookup and a head method; tests/runner/test_forward_invariance.py checks the
    int8 forward bitwise)."""
    key = (concurrency, "int8")
    if key not in _baseline:
        _baseline[key] = run(model_int8, None, PROMPTS[:concurrency], quantization="int8")[0]
    tokens, _ = run(model_int8, method, PROMPTS[:concurrency], quantization="int8")
    assert model_int8.kernel_choice is not None
    assert model_int8.kernel_choice.kernel.name == "fbgemm-int8"
    assert tokens == _baseline[key]


def test_a_shared_model_packed_otherwise_is_refused(model: LlamaForCausalLM) -> None:
    LLM(loaded_model=model)  # packs it in float32
    with pytest.raises(ValueError, match="packed for quantization=None, this engine asks "
                                         "for quantization=int8"):
        LLM(loaded_model=model, quantization="int8")


def test_self_draft_accepts_everything(model: LlamaForCausalLM) -> None:
    """draft_model with the target as its own draft: acceptance 1.0, length K + 1 (K
    every step: the fixed policy; goodput may judge fewer drafts worth it)."""
    llm = LLM(loaded_model=model, speculative_config={"method": "draft_model",
                                                      "num_speculative_tokens": 4,
                                                      "draft_policy": "fixed"})
    # 21 tokens = 1 from the prefill + four steps of 4 accepted drafts + 1 bonus.
    llm.generate(OPEN[:2], SamplingParams(max_tokens=21, ignore_eos=True))
    spec = llm.get_metrics()["spec_decode"]
    assert spec["num_drafts"] == 8
    assert spec["acceptance_rate"] == 1.0
    assert spec["mean_acceptance_length"] == 5.0
    assert spec["acceptance_per_pos"] == [1.0, 1.0, 1.0, 1.0]


def test_metrics_count_drafts_and_acceptance(model: LlamaForCausalLM) -> None:
    _, metrics = run(model, "ngram", GROUNDED)
    spec = metrics["spec_decode"]
    assert sum(spec["num_draft_tokens_per_pos"]) == spec["num_draft_tokens"]
    assert sum(spec["num_accepted_tokens_per_pos"]) == spec["num_accepted_tokens"]
    assert 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["acceptance_rate"] == spec["num_accepted_tokens"] / spec["num_draft_tokens"]
    assert len(spec["acceptance_per_pos"]) == K
    assert spec["num_draft_tokens_per_pos"][0] == spec["num_drafts"]
    # Acceptance is a prefix: position i+1 is accepted only after position i was.
    accepted = spec["num_accepted_tokens_per_pos"]
    assert all(a >= b for a, b in itertools.pairwise(accepted))
    assert 1 + spec["num_accepted_tokens"] / spec["num_drafts"] == spec["mean_acceptance_length"]


def test_drafter_buffers_bounded_and_target_buffers_unchanged(model: LlamaForCausalLM) -> None:
    off = LLM(loaded_model=model, max_num_batched_tokens=64, num_kv_blocks=8,
              max_model_len=96).engine.runner
    for method in METHODS:
        runner = LLM(loaded_model=model, max_num_batched_tokens=64, num_kv_blocks=8,
                     max_model_len=96,
                     speculative_config=spec_dict(method, 4)
                     ).engine.runner
        assert runner.persistent_buffer_bytes == off.persistent_buffer_bytes
        hidden = model.config.hidden_size * 4
        assert runner.drafter_buffer_bytes <= 64 * hidden


@pytest.mark.parametrize("method", [None, "ngram"])
def test_logprobs_one_per_emitted_token(model: LlamaForCausalLM, method: str | None) -> None:
    """Verification emits several tokens per step: each gets its own logprobs entry,
    the emitted token first, then the top 2 from the raw logits."""
    spec = spec_dict(method, K)
    llm = LLM(loaded_model=model, speculative_config=spec)
    ids = llm.tokenizer.encode(GROUNDED[2])
    from scheduler import Request

    llm.engine.add_request(Request("r", ids, SamplingParams(max_tokens=12, logprobs=2)))
    multi = False
    while llm.engine.has_unfinished_requests():
        for update in llm.engine.step():
            assert len(update.logprobs) == len(update.new_token_ids)
            multi |= len(update.new_token_ids) > 1
            for token, (top_ids, lps) in zip(update.new_token_ids, update.logprobs, strict=True):
                assert top_ids[0] == token and len(top_ids) == 3
                assert lps[1] >= lps[2] and lps[0] <= lps[1] + 1e-6
    assert multi == (method is not None)


def test_head_round_trips_through_its_checkpoint_dir(model: LlamaForCausalLM,
                                                    tmp_path: Any) -> None:
    """A head saved in the EAGLE-3 layout is what `"model": DIR` loads, tensor for
    tensor; a dir that is not such a head is refused, naming what is missing."""
    from runner.eagle3 import Eagle3Config, Eagle3Head, save_eagle3

    head = Eagle3Head(Eagle3Config.for_target(model.config, 512), model, seed=7)
    with torch.no_grad():
        head.d2t.copy_(torch.arange(512) * 3)  # draft id i -> target id 4i
    save_eagle3(head, tmp_path / "head")
    llm = LLM(loaded_model=model, num_kv_blocks=8, max_model_len=96, speculative_config={
        "method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path / "head")})
    loaded = llm.engine.runner.spec.drafter.net  # type: ignore[union-attr]
    for (name, want), (_, got) in zip(head.state_dict().items(),
                                      loaded.state_dict().items(), strict=True):
        assert torch.equal(want, got), name
    (out,) = llm.generate(["The capital of France is"], PARAMS)
    assert "Paris" in out.outputs[0].text  # lossless whatever the head drafts
    (tmp_path / "bad").mkdir()
    (tmp_path / "head" / "config.json").rename(tmp_path / "bad" / "config.json")
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(1)}, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ValueError, match="not an EAGLE-3 head: missing"):
        LLM(loaded_model=model, num_kv_blocks=8, max_model_len=96, speculative_config={
            "method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path / "bad")})


@pytest.mark.parametrize("method", ["pard", "dflash", "eagle"])
def test_runner_refuses_a_drafter_pass_that_disagrees(model: LlamaForCausalLM,
                                                      method: str) -> None:
    """A SchedulerOutput that under-declares the drafter's widest pass is refused
    before any buffer is written."""
    import dataclasses

    from runner import BudgetInvariantError
    from scheduler import Request

    llm = LLM(loaded_model=model, max_num_batched_tokens=64, num_kv_blocks=16,
              max_model_len=192,
              speculative_config=spec_dict(method, 3))
    core = llm.engine
    core.add_request(Request("r", list(range(100, 120)), SamplingParams(max_tokens=8)))
    out = core.scheduler.schedule()
    core.runner.buffers.input_ids.np[:] = -7
    forged = dataclasses.replace(out, num_drafter_tokens=out.num_drafter_tokens - 1)
    with pytest.raises(BudgetInvariantError, match=method):
        core.runner.execute(forged)
    assert (core.runner.buffers.input_ids.np == -7).all()
    assert len(core.runner.states) == 0  # the new request was not even given a row
    result = core.runner.execute(out)  # the honest output runs
    assert max(v for p, v in result.pass_rows.items() if p != "target") == \
        out.num_drafter_tokens


def test_out_of_vocab_prompt_is_refused_and_others_still_served(
        model: LlamaForCausalLM) -> None:
    llm = LLM(loaded_model=model, num_kv_blocks=16, max_model_len=192)
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt must be token ids in "
                                         r"\[0, 49152\)"):
        llm.generate([[5, 49152, 7]], PARAMS)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.generate([[5, 6], [5, -1]], PARAMS)  # the valid first prompt is dropped too
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate(["The capital of France is"], PARAMS)
    assert "Paris" in out.outputs[0].text
