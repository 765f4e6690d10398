"""Speculative decoding: config and per-method drafter layouts (torch-free imports)."""

from spec_decode.config import DRAFT_POLICIES, METHODS, SpeculativeConfig
from spec_decode.layout import DrafterLayout, get_layout, min_decode_rows

__all__ = [
    "DRAFT_POLICIES", "METHODS", "DrafterLayout", "SpeculativeConfig", "get_layout",
    "min_decode_rows",
]
