"""Strict JSON for request bodies: what `json.loads` accepts but no request may hold.

Refused, each with the path of the offending value: `NaN` / `Infinity` literals,
strings with a lone UTF-16 surrogate (JSON allows "\\ud800"; UTF-8 and the tokenizer
do not), nesting deeper than MAX_JSON_DEPTH (no field nests more than a few levels; a
10,000-deep body would exhaust the parser's stack), and bodies that are not an object.
"""

from __future__ import annotations

import json
from typing import Any

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: far past any prompt a context length allows


class InvalidJSON(ValueError):
    """A body that is not strict JSON; `param` is the path of the bad value, if any."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def load_strict_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or InvalidJSON saying what is wrong and where."""
    try:
        data = json.loads(raw, parse_constant=_NonFinite)
    except ValueError as err:  # UnicodeDecodeError included
        raise InvalidJSON(f"Invalid JSON body: {err}") from None
    except RecursionError:
        raise InvalidJSON(f"Invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels"
                          ) from None
    if not isinstance(data, dict):
        raise InvalidJSON("The request body must be a JSON object")
    found = _find_bad_value(data)
    if found:
        raise InvalidJSON(f"{found[0]}: {found[1]}", param=found[0])
    return data


class _NonFinite:
    """Stands in for a NaN / Infinity literal while parsing, so its field can be named."""

    def __init__(self, literal: str) -> None:
        self.literal = literal


MAX_JSON_DEPTH = 32  # no field nests deeper than a few levels; deeper is refused


def _bad_string(text: str) -> bool:
    """A lone surrogate (JSON allows "\\ud800"; UTF-8 and the tokenizer do not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _find_bad_value(data: Any) -> tuple[str, str] | None:
    """The first value no field may hold, as (path, why): a NaN / Infinity literal, a
    string with a lone surrogate, or nesting past MAX_JSON_DEPTH. Iterative, so a
    deeply nested body cannot exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, _NonFinite):
            return path, f"{value.literal} is not valid JSON (numbers must be finite)"
        if isinstance(value, str) and _bad_string(value):
            return path, "the string holds a lone UTF-16 surrogate (not valid Unicode)"
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            return path, f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _bad_string(key):
                return path or "body", "a key holds a lone UTF-16 surrogate"
            stack.append((item, where, depth + 1))
    return None
