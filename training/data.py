"""Training text the machine already has, split so that evaluation never sees a
training source.

Code: the Python standard library's own modules, teacher-forced. A file goes to the
evaluation split when a stable hash of its name lands in one bucket of ten, so the
two splits share no file.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch

from engine.tokenizer import Tokenizer


def is_eval_source(name: str, buckets: int = 10) -> bool:
    """Stable across runs and machines (unlike hash())."""
    return hashlib.sha256(name.encode()).digest()[0] % buckets == 0


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)


def code_windows(tokenizer: Tokenizer, length: int, max_windows: int, split: str
                 ) -> torch.Tensor:
    """[N, length] token windows cut from standard-library files of one split."""
    want_eval = split == "eval"
    windows: list[list[int]] = []
    for path in stdlib_files():
        if is_eval_source(path.name) != want_eval:
            continue
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        for start in range(0, len(ids) - length + 1, length):
            windows.append(ids[start:start + length])
            if len(windows) == max_windows:
                return torch.tensor(windows, dtype=torch.int64)
    return torch.tensor(windows, dtype=torch.int64).view(-1, length)
