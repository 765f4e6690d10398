"""The speculative methods, one module each, registered by name.

Adding a method is adding one module here that defines a `SpecMethod` subclass under
`@register`: every module of this package is imported below, so the scheduler (cost
table), the runners (pass assembly, the drafter its kind names), training (the head's
layout) and the CLI (choices) all see it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from spec_decode.methods.base import PassRecipe, SpecMethod, TrainLayout, context_rows

_REGISTRY: dict[str, SpecMethod] = {}
M = TypeVar("M", bound=type[SpecMethod])


def register(cls: M) -> M:
    """Class decorator: make `cls` the method named `cls.name`."""
    if cls.name in _REGISTRY:
        raise ValueError(f"speculative method {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls()
    return cls


@contextmanager
def registered(cls: type[SpecMethod]) -> Iterator[SpecMethod]:
    """`cls` registered for the block only (tests, experiments), then removed: the
    public way to try a method without a module in this package."""
    register(cls)
    try:
        yield _REGISTRY[cls.name]
    finally:
        del _REGISTRY[cls.name]


def get_method(name: str) -> SpecMethod:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"speculative method {name!r} is not registered; choose one of "
                         f"{', '.join(method_names())}") from None


def method_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["PassRecipe", "SpecMethod", "TrainLayout", "context_rows", "get_method",
           "method_names", "register", "registered"]
