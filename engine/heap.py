"""The process's heap frozen while an engine steps (`frozen_heap`).

CPython's full (generation 2) collection scans every tracked object, and one falls due
each time the long-lived objects grow by a quarter. With torch, the tokenizer and the
model loaded that is ~320,000 objects and 8-130 ms a collection (measured), landing on
whichever engine step allocates at the time: a suffix drafter's tree nodes made one
step of a 135-step run 150 ms long, 3 % of the run. Frozen (`gc.freeze`), the objects
that stood before the engine started stepping are left out of every scan, so a
collection scans only what was made since. The engine core process freezes its heap
once, after loading (engine/core_process.py); an engine stepped in the caller's
process (`LLM.generate`, engines side by side) freezes it while it steps and thaws it
after, so what the caller drops later is collected again.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # blocks open: nested (engines side by side), or on several threads


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the heap as it stands for the block, unless an enclosing block has; the
    last block to close thaws it. No collection first (~0.1 s): garbage frozen with
    the rest is collected once thawed."""
    global _depth
    with _lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
