"""Config validation: bad values are refused naming the field; configs are frozen;
the Scheduler refuses a budget too small for one decoding request under the method."""

from __future__ import annotations

import dataclasses

import pytest

from runner.simulated import SimulatedRunner
from scheduler import CacheConfig, SamplingParams, Scheduler, SchedulerConfig
from spec_decode import METHODS, SpeculativeConfig
from tests.helpers import make_request, run_step

# ---- SchedulerConfig --------------------------------------------------------------


@pytest.mark.parametrize("field", ["max_num_batched_tokens", "max_num_seqs", "max_model_len"])
@pytest.mark.parametrize("value", [0, -1])
def test_scheduler_config_rejects_non_positive_limits(field: str, value: int) -> None:
    kwargs = {"max_num_batched_tokens": 64, "max_num_seqs": 4, "max_model_len": 64}
    kwargs[field] = value
    with pytest.raises(ValueError, match=rf"SchedulerConfig\.{field} must be >= 1"):
        SchedulerConfig(**kwargs)


def test_scheduler_config_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match=r"policy='lifo'.*fcfs, priority"):
        SchedulerConfig(64, 4, 64, policy="lifo")


def test_scheduler_config_rejects_negative_long_prefill_threshold() -> None:
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        SchedulerConfig(64, 4, 64, long_prefill_token_threshold=-1)


def test_scheduler_config_without_chunking_needs_budget_for_a_whole_prompt() -> None:
    expected = r"max_num_batched_tokens must be >= max_model_len \(128\)"
    with pytest.raises(ValueError, match=expected):
        SchedulerConfig(64, 4, 128, enable_chunked_prefill=False)
    config = SchedulerConfig(128, 4, 128, enable_chunked_prefill=False)
    assert config.max_num_batched_tokens == 128
    # With chunking on, a budget below max_model_len is fine.
    assert SchedulerConfig(64, 4, 128).enable_chunked_prefill


def test_scheduler_config_defaults() -> None:
    config = SchedulerConfig(64, 4, 128)
    assert config.enable_chunked_prefill is True
    assert config.policy == "fcfs"
    assert config.long_prefill_token_threshold == 0
    assert SchedulerConfig(64, 4, 128, policy="priority").policy == "priority"


# ---- CacheConfig ---------------------------------------------------------------------


@pytest.mark.parametrize("field", ["block_size", "num_blocks"])
@pytest.mark.parametrize("value", [0, -3])
def test_cache_config_rejects_non_positive(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"CacheConfig\.{field} must be >= 1"):
        CacheConfig(**{field: value})


def test_cache_config_defaults() -> None:
    config = CacheConfig()
    assert config.block_size == 16
    assert config.enable_prefix_caching is True
    assert config.num_blocks >= 1


# ---- SpeculativeConfig -----------------------------------------------------------------


def test_speculative_config_rejects_unknown_method() -> None:
    with pytest.raises(ValueError, match=r"method='medusa' is not supported"):
        SpeculativeConfig("medusa", 4)


@pytest.mark.parametrize("k", [0, -2])
def test_speculative_config_rejects_non_positive_k(k: int) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        SpeculativeConfig("eagle", k)


@pytest.mark.parametrize(("lo", "hi"), [(0, 4), (5, 4), (-1, -1)])
def test_speculative_config_rejects_bad_prompt_lookup_range(lo: int, hi: int) -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig("ngram", 3, prompt_lookup_min=lo, prompt_lookup_max=hi)


@pytest.mark.parametrize("method", METHODS)
def test_speculative_config_accepts_every_method(method: str) -> None:
    config = SpeculativeConfig(method, 2)
    assert config.method == method
    assert config.num_speculative_tokens == 2


def test_from_dict_none_is_off() -> None:
    assert SpeculativeConfig.from_dict(None) is None


def test_from_dict_splits_known_fields_and_options() -> None:
    config = SpeculativeConfig.from_dict({
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5, "model": None, "max_window": 64,
    })
    assert config is not None
    assert config.method == "ngram"
    assert config.num_speculative_tokens == 3
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 5)
    assert config.options == {"max_window": 64}
    # Options take no part in equality: the same method and K are the same config.
    assert config == SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=5)


@pytest.mark.parametrize(("spec", "message"), [
    ({"method": "ngram", "num_speculative_tokens": 3, "bogus": 1},
     r"unknown keys \['bogus'\] for method 'ngram'; known: \[.*'max_window'\]"),
    ({"method": "eagle", "num_speculative_tokens": 3, "max_window": 8},
     r"unknown keys \['max_window'\] for method 'eagle'"),
    ({"method": "ngram", "num_speculative_tokens": True},
     r"num_speculative_tokens must be an integer, got True"),
    ({"method": "ngram", "num_speculative_tokens": 3.5},
     r"num_speculative_tokens must be an integer, got 3\.5"),
    ({"method": "ngram", "num_speculative_tokens": "3"},
     r"num_speculative_tokens must be an integer, got '3'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2.0},
     r"prompt_lookup_max must be an integer"),
    ({"method": 7, "num_speculative_tokens": 3}, r"method=7 is not supported"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": 5},
     r"model must be a string"),
    (["ngram", 3], r"speculative_config must be a dict or None"),
    ({"method": "dflash", "num_speculative_tokens": 3, "park_drafter": "no"},
     r"park_drafter must be true or false, got 'no'"),
])
def test_from_dict_refuses_wrong_types_and_unknown_keys(spec: object, message: str) -> None:
    """Booleans are not integers, and a misspelt setting is never silently ignored."""
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(spec)  # type: ignore[arg-type]


def test_every_methods_own_options_are_accepted() -> None:
    suffix = {"max_tree_depth": 8, "max_cached_requests": 3, "min_token_prob": 0.2,
              "max_spec_factor": 1.5}
    config = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 3,
                                          **suffix})
    assert config is not None and config.options == suffix
    for method in ("eagle", "mtp", "parallel", "dflash"):
        assert SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 2,
                                            "seed": 3, "mask_token_id": 0}) is not None


def test_from_dict_carries_model_name() -> None:
    config = SpeculativeConfig.from_dict(
        {"method": "draft_model", "num_speculative_tokens": 2, "model": "smollm2-135m"})
    assert config is not None
    assert config.model == "smollm2-135m"
    assert config.options == {}


def test_from_dict_validates_like_the_constructor() -> None:
    with pytest.raises(ValueError, match="not supported"):
        SpeculativeConfig.from_dict({"method": "bogus", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 0})


# ---- SamplingParams ----------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    # 64-bit edges: each used to overflow an int64 array inside an engine step.
    ({"top_k": 1 << 63}, "top_k"),
    ({"max_tokens": 1 << 63}, "max_tokens"),
    ({"seed": 1 << 63}, "seed"),
    ({"seed": -(1 << 63) - 1}, "seed"),
    ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"top_k": True}, "top_k"),
    ({"stop_token_ids": [1 << 63]}, r"stop_token_ids\[0\]"),
    ({"stop_token_ids": [-1]}, r"stop_token_ids\[0\]"),
    ({"stop": [""]}, "stop"),
])
def test_sampling_params_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_edges_and_normalises_sequences() -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, min_p=1.0,
                            min_tokens=1, logprobs=0, stop_token_ids=[3, 4], stop=["x"])
    assert params.stop_token_ids == (3, 4)
    assert params.stop == ("x",)
    hash(params)  # hashable once the lists became tuples
    top = SamplingParams(max_tokens=(1 << 63) - 1, top_k=(1 << 63) - 1, seed=-(1 << 63),
                         logprobs=20)
    assert top.top_k == (1 << 63) - 1


def test_top_k_at_the_int64_edge_runs_in_the_runner() -> None:
    """The largest top_k the params accept fits the runner's int64 arrays and filters
    nothing (it is larger than any vocabulary)."""
    import numpy as np

    from runner.sampler import Sampler
    from spec_decode.sampling import SamplingMetadata

    params = SamplingParams(temperature=1.0, top_k=(1 << 63) - 1, seed=3)
    meta = SamplingMetadata.from_arrays(
        temperature=np.array([1.0], np.float32), top_p=np.array([1.0], np.float32),
        top_k=np.array([params.top_k], np.int64), min_p=np.array([0.0], np.float32),
        seeds={}, max_num_logprobs=None)
    import torch

    out = Sampler()(torch.zeros(1, 8), meta)
    assert 0 <= int(out.sampled_token_ids[0]) < 8


# ---- frozen -------------------------------------------------------------------------


@pytest.mark.parametrize(("config", "field", "value"), [
    (SchedulerConfig(64, 4, 64), "max_num_batched_tokens", 128),
    (SchedulerConfig(64, 4, 64), "policy", "priority"),
    (CacheConfig(), "num_blocks", 7),
    (SpeculativeConfig("eagle", 2), "num_speculative_tokens", 9),
    (SamplingParams(), "max_tokens", 99),
])
def test_configs_are_frozen(config: object, field: str, value: object) -> None:
    before = getattr(config, field)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, field, value)
    assert getattr(config, field) == before


# ---- budget too small for one decoding request ----------------------------------------


def _min_budget(method: str, k: int) -> int:
    """DESIGN.md §1 for one decoding request: n = 1 + k rows, proposing k drafts."""
    n = 1 + k
    drafter = {
        "ngram": 0, "suffix": 0, "eagle": n, "mtp": n, "draft_model": n + 1,
        "parallel": n + k - 1, "pard": n + k, "dflash": max(n, k + 1),
    }[method]
    return max(n, drafter)


def _scheduler(method: str | None, k: int, budget: int) -> Scheduler:
    spec = SpeculativeConfig(method, k, draft_policy="fixed") if method else None
    return Scheduler(SchedulerConfig(budget, 4, 512), CacheConfig(block_size=4, num_blocks=256),
                     spec)


@pytest.mark.parametrize(("method", "k", "need"), [
    ("pard", 4, 9), ("dflash", 4, 5), ("draft_model", 4, 6), ("parallel", 4, 8),
    ("eagle", 4, 5), ("ngram", 4, 5), ("pard", 1, 3), ("parallel", 1, 2),
])
def test_budget_minimum_matches_design_table(method: str, k: int, need: int) -> None:
    assert _min_budget(method, k) == need


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_scheduler_refuses_budget_below_one_decode(method: str, k: int) -> None:
    need = _min_budget(method, k)
    with pytest.raises(ValueError, match=rf"max_num_batched_tokens >= {need}\b") as info:
        _scheduler(method, k, need - 1)
    assert method in str(info.value)
    _scheduler(method, k, need)  # exactly the minimum is accepted


@pytest.mark.parametrize(("method", "need"), [("pard", 9), ("dflash", 5), ("draft_model", 6),
                                              ("parallel", 8)])
def test_budget_at_the_minimum_serves_full_speculation(method: str, need: int) -> None:
    with pytest.raises(ValueError, match=str(need)):
        _scheduler(method, 4, need - 1)
    scheduler = _scheduler(method, 4, need)
    runner = SimulatedRunner(scheduler, acceptance=0.0)
    scheduler.add_request(make_request("a", 3, max_tokens=50, ignore_eos=True))
    run_step(scheduler, runner)  # prefill
    out, _ = run_step(scheduler, runner)  # decode: 1 + 4 verified, 4 new drafts
    assert out.num_scheduled_tokens == {"a": 5}
    assert out.num_draft_tokens == {"a": 4}
    assert max(out.pass_rows.values()) == need


def test_no_speculation_needs_no_minimum_budget() -> None:
    scheduler = _scheduler(None, 0, 1)
    runner = SimulatedRunner(scheduler)
    request = make_request("a", 3, max_tokens=2, ignore_eos=True)
    scheduler.add_request(request)
    for _ in range(5):
        run_step(scheduler, runner)
    assert len(request.output_token_ids) == 2


def test_which_methods_park() -> None:
    """A drafter with its own KV (head, draft LM) parks unless told not to; a lookup
    method has no drafter pass to skip."""
    def parks(method: str, **kwargs: object) -> bool:
        config = SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 2,
                                              **kwargs})
        assert config is not None
        return config.parks

    assert parks("dflash") and parks("eagle") and parks("draft_model") and parks("pard")
    assert not parks("ngram") and not parks("suffix")
    assert not parks("dflash", park_drafter=False)
