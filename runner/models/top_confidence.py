"""A drafter's readout, top k ids and the best one's probability, in one compiled call
on the CPU (top_confidence.c); `spec_decode.sampling.top_with_confidence` elsewhere.

The head's readout runs once a drafter pass, on a row or a few of its draft
vocabulary's logits, right after the LM head's weight has streamed through the
caches. torch's ten-odd small calls for it cost ~236 us a row there (74 warm: a /tmp
timing, 8,192 logits); the compiled pass 55 (17 warm). The ids are those of
`top_with_confidence` (best first, the first index of the maximum leading), the
probability the same within float32's rounding (it sums in another order).
`tests/runner/test_top_confidence.py` holds the two together.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from runner import native
from spec_decode.sampling import top_with_confidence

SOURCE = Path(__file__).with_name("top_confidence.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=gnu11", "-shared", "-fPIC")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_K = 16  # as the source's


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    lib, why = native.try_compiled(SOURCE, FLAGS, "compiled readout", "torch's serves")
    if lib is None:
        return None, why
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn = lib.specbudget_top_confidence
    fn.argtypes = [i32, ptr, i64, i64, i64, i32, ptr, ptr]
    fn.restype = ctypes.c_int
    return lib, ""


def top_confidence(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_with_confidence(logits, top_k)` ([N, top_k] ids, [N] float32), through the
    compiled call where it reads these logits (CPU float32 or bfloat16 rows of
    contiguous values, top_k at most MAX_K), else torch's."""
    lib = load()[0]
    code = DTYPES.get(logits.dtype)
    if (lib is None or code is None or logits.dim() != 2 or logits.device.type != "cpu"
            or logits.stride(1) != 1 or not 1 <= top_k <= min(MAX_K, logits.shape[1])):
        return top_with_confidence(logits.float(), top_k)
    rows, vocab = logits.shape
    ids = torch.empty((rows, top_k), dtype=torch.int64)
    confidence = torch.empty(rows, dtype=torch.float32)
    status = lib.specbudget_top_confidence(code, logits.data_ptr(), logits.stride(0), rows,
                                           vocab, top_k, ids.data_ptr(),
                                           confidence.data_ptr())
    assert status == 0, "top_k was checked against the library's limits"
    return ids, confidence
