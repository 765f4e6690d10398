"""The compiled readout (runner/models/top_confidence.py) against
`spec_decode.sampling.top_with_confidence`: the same ids, the same probability within
float32's rounding, ties broken as `argmax` breaks them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from runner.models import top_confidence as readout
from runner.models.top_confidence import MAX_K, top_confidence
from spec_decode.sampling import greedy_ids, top_with_confidence

needs_library = pytest.mark.skipif(readout.load()[0] is None,
                                   reason=f"no compiled readout here: {readout.load()[1]}")


Readout = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def _check_against_torch(fn: Readout, dtype: torch.dtype, rows: int, vocab: int,
                         top_k: int) -> None:
    gen = torch.Generator().manual_seed(rows * vocab + top_k)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    ids, confidence = fn(logits, top_k)
    want_ids, want_confidence = top_with_confidence(logits.float(), top_k)
    assert ids.dtype == torch.int64 and confidence.dtype == torch.float32
    # the greedy id first; the others' values alike (torch orders equal values after
    # the first as it likes, and bfloat16 logits tie often), no id twice
    assert torch.equal(ids[:, 0], want_ids[:, 0])
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    assert all(len(set(row)) == top_k for row in ids.tolist())
    if dtype == torch.float32:  # no ties among random float32 logits
        assert torch.equal(ids, want_ids)
    torch.testing.assert_close(confidence, want_confidence, rtol=1e-5, atol=1e-9)


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rows", "vocab", "top_k"),
                         [(1, 8192, 1), (1, 8192, 4), (3, 8192, 2), (16, 8192, 8),
                          (2, 37, MAX_K), (1, 5, 5)])
def test_it_equals_torchs_readout(dtype: torch.dtype, rows: int, vocab: int,
                                  top_k: int) -> None:
    _check_against_torch(top_confidence, dtype, rows, vocab, top_k)


@needs_library
@pytest.mark.parametrize("broken", ["ids reversed", "confidence off", "an id twice"])
def test_the_check_sees_a_broken_readout(broken: str) -> None:
    """Broken on purpose: the check above must fail on each."""
    def twin(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, confidence = top_confidence(logits, top_k)
        if broken == "ids reversed":
            return ids.flip(-1), confidence
        if broken == "an id twice":
            return torch.cat([ids[:, :1], ids[:, :-1]], dim=1), confidence
        return ids, confidence * 1.001

    with pytest.raises(AssertionError):
        _check_against_torch(twin, torch.float32, 3, 8192, 4)


@needs_library
def test_ties_keep_index_order_and_lead_with_argmax() -> None:
    """bfloat16 logits tie often: the first index of the maximum leads (a chain's
    draft), then equal values by index, no id twice, whether more or fewer values tie
    than ids are asked for."""
    logits = torch.zeros(3, 40, dtype=torch.bfloat16)
    logits[0, [9, 3, 30]] = 2.0
    logits[1, [5, 6]] = 1.0
    logits[1, 2] = 3.0
    ids, confidence = top_confidence(logits, 4)
    assert ids.tolist() == [[3, 9, 30, 0], [2, 5, 6, 0], [0, 1, 2, 3]]
    assert torch.equal(ids[:, 0], greedy_ids(logits.float()))
    torch.testing.assert_close(confidence, torch.softmax(logits.float(), -1).max(-1).values)


def test_what_it_cannot_read_goes_to_torch() -> None:
    """Strided rows, float16 and more ids than the library keeps: torch's readout,
    the same answer."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 3, generator=gen).t()  # rows 1 apart, values 3 apart
    assert logits.stride(1) != 1
    for case, top_k in ((logits, 4), (logits.contiguous().half(), 2),
                        (logits.contiguous(), MAX_K + 1)):
        ids, confidence = top_confidence(case, top_k)
        want_ids, want_confidence = top_with_confidence(case.float(), top_k)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(confidence, want_confidence)
