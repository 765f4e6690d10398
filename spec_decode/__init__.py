"""Speculative decoding: config and the per-method cost tables and pass recipes
(torch-free imports)."""

from spec_decode.config import DRAFT_POLICIES, METHODS, SpeculativeConfig, min_decode_rows
from spec_decode.methods import SpecMethod, get_method

__all__ = [
    "DRAFT_POLICIES", "METHODS", "SpecMethod", "SpeculativeConfig", "get_method",
    "min_decode_rows",
]
