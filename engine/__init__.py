"""Engine: the parts a user touches (offline LLM, engine core, CLI).

`from engine import LLM` loads torch lazily, on first use of the name.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
