"""Drafted token trees (`draft_top_k`) end to end on the default model.

The drafter is a real draft model: the target cut to its first layers (DESIGN.md §5:
cutting layers gives a draft that agrees some of the time), so chains are accepted,
rejected, and rejected drafts' places taken by leaves. Each run must equal speculation
off token for token (greedy, seeded sampling, logprobs, min_tokens, the length
limits), win tokens from leaves, and leave no KV block behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from engine.llm import LLM
from runner.model_prep import resolve_model
from scheduler import SamplingParams
from tests.e2e.test_min_tokens import CHAT
from tests.e2e.test_spec_boundaries import run_cases
from tests.e2e.test_spec_e2e import PROMPTS
from tests.server_helpers import default_model

pytestmark = pytest.mark.model  # loads the real default model

DRAFT_LAYERS = 12


@pytest.fixture(scope="module")
def cut_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's first DRAFT_LAYERS layers as a checkpoint of its own."""
    return cut(tmp_path_factory, DRAFT_LAYERS)


def cut(tmp_path_factory: pytest.TempPathFactory, layers: int) -> Path:
    source = resolve_model(None)
    out = tmp_path_factory.mktemp(f"cut_draft_{layers}")
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((source / name).read_bytes())
    weights = load_file(source / "model.safetensors")
    kept = {key: value for key, value in weights.items()
            if not key.startswith("model.layers.")
            or int(key.split(".")[2]) < layers}
    save_file(kept, out / "model.safetensors")
    return out


def tree_spec(draft: Path | None, top_k: int | list[int], depth: int = 3,
              **extra: Any) -> dict[str, Any] | None:
    """Trees of `depth` (widths per depth from a list, its last repeating)."""
    if draft is None:
        return None
    widths = top_k if isinstance(top_k, list) else [top_k]
    k = sum(widths[min(d, len(widths) - 1)] for d in range(depth))
    return {"method": "draft_model", "model": str(draft), "draft_policy": "fixed",
            "num_speculative_tokens": k, "draft_top_k": top_k, **extra}


def generate(spec: dict[str, Any] | None, prompts: list[str], params: SamplingParams,
             **kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    kwargs.setdefault("max_num_batched_tokens", 64)
    llm = LLM(loaded_model=default_model(), speculative_config=spec, max_num_seqs=16,
              max_model_len=256, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache_usage() == 0.0
    return [o.outputs[0] for o in outs], llm.get_metrics()["spec_decode"]


_off: dict[tuple[int, str], list[Any]] = {}


def off(prompts: int, params: SamplingParams) -> list[Any]:
    key = (prompts, repr(params))
    if key not in _off:
        _off[key] = generate(None, PROMPTS[:prompts], params)[0]
    return _off[key]


GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("top_k", [2, 3, [4, 2, 1]], ids=str)
@pytest.mark.parametrize("concurrency", [1, 16])
def test_greedy_trees_equal_speculation_off_and_win_leaves(
        cut_draft: Path, top_k: int | list[int], concurrency: int) -> None:
    """B = 64 chunks the longer prompts and mixes them with verifications."""
    got, spec = generate(tree_spec(cut_draft, top_k), PROMPTS[:concurrency], GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in off(concurrency, GREEDY)]
    assert spec["num_leaf_hits"] > 0


def test_leaves_add_tokens_a_chain_of_the_same_drafter_leaves(cut_draft: Path) -> None:
    """The same draft and depth with one candidate a depth: fewer tokens a step."""
    _, tree = generate(tree_spec(cut_draft, 3), PROMPTS[:4], GREEDY)
    _, chain = generate(tree_spec(cut_draft, 1), PROMPTS[:4], GREEDY)
    assert chain["num_leaf_hits"] == 0
    assert tree["mean_acceptance_length"] > chain["mean_acceptance_length"]


def test_seeded_sampling_with_trees_equals_speculation_off(cut_draft: Path) -> None:
    """A leaf's bonus token is drawn with its position's key, as a decode's is."""
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=7,
                            ignore_eos=True)
    got, spec = generate(tree_spec(cut_draft, 2), PROMPTS[:4], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in off(4, params)]
    assert spec["num_leaf_hits"] > 0


def test_logprobs_of_leaf_tokens_are_the_target_s(cut_draft: Path) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    got, spec = generate(tree_spec(cut_draft, 2), PROMPTS[:4], params)
    assert spec["num_leaf_hits"] > 0
    for mine, theirs in zip(got, off(4, params), strict=True):
        assert mine.token_ids == theirs.token_ids
        assert len(mine.logprobs) == len(mine.token_ids)
        for a, b in zip(mine.logprobs, theirs.logprobs, strict=True):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-5)


def test_min_tokens_holds_on_a_leaf_s_bonus(cut_draft: Path) -> None:
    """Short answers held open to 20 tokens: EOS is what the target wants at many of
    those positions, and is masked on every row before min_tokens, a leaf's too."""
    def chat(spec: dict[str, Any] | None) -> tuple[list[list[int]], dict[str, Any]]:
        llm = LLM(loaded_model=default_model(), speculative_config=spec)
        outs = llm.chat(CHAT, SamplingParams(max_tokens=30, min_tokens=20), use_tqdm=False)
        assert llm.engine.scheduler.kv_cache_usage() == 0.0
        return [list(o.outputs[0].token_ids) for o in outs], llm.get_metrics()["spec_decode"]

    tokens, spec = chat(tree_spec(cut_draft, 3))
    assert spec["num_leaf_hits"] > 0
    assert tokens == chat(None)[0]


def test_trees_at_the_length_limits(cut_draft: Path) -> None:
    """test_spec_boundaries' cases: up to max_model_len and max_tokens and one past."""
    llm, tokens, reasons = run_cases(tree_spec(cut_draft, 2, depth=2))
    assert llm.engine.scheduler.kv_cache_usage() == 0.0
    assert (tokens, reasons) == run_cases(None)[1:]


def test_stops_inside_a_step_a_leaf_extended(cut_draft: Path) -> None:
    """Stop token ids and stop strings taken from speculation off's own answers, at
    positions through them: a stop that lands on a recovered token (a leaf then adds
    its bonus after it) or on a leaf's bonus must end the answer where off's ends,
    text and finish reason alike, and drop what the step emitted after it."""
    engines = {name: LLM(loaded_model=default_model(), speculative_config=spec,
                         max_num_seqs=4, max_model_len=256)
               for name, spec in (("off", None), ("tree", tree_spec(cut_draft, 3)))}
    prompts = PROMPTS[:4]
    answers = [o.outputs[0].token_ids for o in engines["off"].generate(prompts, GREEDY,
                                                                       use_tqdm=False)]
    decode = engines["off"].tokenizer.decode
    stops = [SamplingParams(max_tokens=16, ignore_eos=True,
                            stop_token_ids=tuple(a[at] for a in answers)) for at in (2, 5, 9)]
    stops += [SamplingParams(max_tokens=16, ignore_eos=True,
                             stop=tuple(decode(a[at:at + 2]) for a in answers))
              for at in (3, 7)]
    for params in stops:
        got = {name: [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                      for o in llm.generate(prompts, params, use_tqdm=False)]
               for name, llm in engines.items()}
        assert got["tree"] == got["off"]
        assert all(len(ids) < 16 for ids, _, _ in got["off"])  # each stopped early
    for llm in engines.values():
        assert llm.engine.scheduler.kv_cache_usage() == 0.0
    assert engines["tree"].get_metrics()["spec_decode"]["num_leaf_hits"] > 0


@pytest.mark.parametrize("method", ["eagle", "mtp", "parallel", "dflash"])
def test_a_head_drafts_trees_losslessly(method: str) -> None:
    """A head method's tree layout through its passes (an untrained head: leaves
    rarely match, the rows and positions are what this checks)."""
    spec = {"method": method, "model": "random", "num_speculative_tokens": 6,
            "draft_top_k": [3, 2], "draft_policy": "fixed"}
    got, metrics = generate(spec, PROMPTS[:4], GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in off(4, GREEDY)]
    assert metrics["num_draft_tokens"] > 0


def test_goodput_drafts_trees_by_depth(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The default policy chooses a depth and charges its nodes: lossless at 1 and 16
    running, and it drafts (a draft of 4 layers, cheap enough to pay)."""
    spec = tree_spec(cut(tmp_path_factory, 4), [4, 2, 1], depth=4)
    assert spec is not None
    spec["draft_policy"] = "goodput"
    for concurrency in (1, 16):
        got, metrics = generate(spec, PROMPTS[:concurrency], GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in off(concurrency, GREEDY)]
        assert metrics["num_drafts"] > 0
