"""Seeded sampling on the default model: reproducible under every
method.

Draws are keyed by (seed, token position), and verification of greedy drafts is
coupled to those draws, so a seeded request's text is the same on every call, under
every method, and equal to its text with speculation off: the suffix proposer's global
tree (which grows with every finished request and so drafts differently on each call)
changes nothing.
"""

from __future__ import annotations

import pytest

from engine.llm import LLM
from scheduler import SamplingParams
from spec_decode import METHODS
from tests.helpers import spec_dict
from tests.server_helpers import default_model

pytestmark = pytest.mark.model  # loads the real default model

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the"


def sampled(method: str | None, seed: int, calls: int = 2) -> list[list[int]]:
    spec = spec_dict(method, 3)
    llm = LLM(loaded_model=default_model(), speculative_config=spec, max_model_len=128,
              num_kv_blocks=32)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=seed,
                            ignore_eos=True)
    return [llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
            for _ in range(calls)]


_off: dict[int, list[int]] = {}


def speculation_off(seed: int) -> list[int]:
    if seed not in _off:
        first, second = sampled(None, seed)
        assert first == second
        _off[seed] = first
    return _off[seed]


@pytest.mark.parametrize("method", METHODS)
def test_seeded_text_is_the_same_every_call_and_equals_speculation_off(method: str) -> None:
    # suffix drafts from every finished response, so each call drafts differently.
    calls = sampled(method, seed=5, calls=3 if method == "suffix" else 1)
    assert all(tokens == speculation_off(5) for tokens in calls), calls


def test_all_64_bits_of_the_seed_count() -> None:
    assert speculation_off(5) != speculation_off(5 + (1 << 32))
    assert speculation_off(5) != speculation_off(5 - (1 << 63))
