"""engine/heap.py: the heap frozen while an engine steps, thawed by the last block out."""

from __future__ import annotations

import gc

import pytest

from engine.heap import frozen_heap
from engine.llm import LLM
from scheduler import SamplingParams
from tests.server_helpers import default_model


def test_nested_blocks_freeze_once_and_the_last_out_thaws() -> None:
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # torch alone leaves more
        # The count can fall while frozen (a frozen object another thread frees leaves
        # it: CI once read 2 fewer), never rise unless something freezes again: a
        # second freeze would take these 1,000 lists (the collector tracks lists).
        made_since = [[] for _ in range(1000)]  # noqa: F841
        with frozen_heap():
            assert gc.get_freeze_count() <= frozen  # the inner block froze nothing more
        assert frozen // 2 < gc.get_freeze_count() <= frozen  # ... nor thawed the outer's
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == 0  # thawed on the way out of a failure too


@pytest.mark.model
def test_the_offline_engine_steps_over_a_frozen_heap() -> None:
    """`LLM.generate` freezes the heap while the engine steps, and thaws it after."""
    llm = LLM(loaded_model=default_model(), num_kv_blocks=16, max_model_len=64)
    seen: list[int] = []
    step = llm.engine.step

    def watched() -> object:
        seen.append(gc.get_freeze_count())
        return step()

    llm.engine.step = watched  # type: ignore[method-assign]
    llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert seen and min(seen) > 10_000 and gc.get_freeze_count() == 0
