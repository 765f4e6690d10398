"""What a proposer reads of the speculative config, as a protocol: the methods and their
proposers type against this leaf, and `SpeculativeConfig` (config.py, which looks the
methods up) satisfies it, so neither imports the other."""

from __future__ import annotations

from typing import Any, Protocol


class MethodSettings(Protocol):
    @property
    def num_speculative_tokens(self) -> int: ...

    @property
    def prompt_lookup_min(self) -> int: ...

    @property
    def prompt_lookup_max(self) -> int: ...

    @property
    def options(self) -> dict[str, Any]: ...
