"""mtp: multi-token-prediction layers drafting like eagle (same passes, cost and training
layout), so it serves with eagle's trained head when none was trained for mtp."""

from __future__ import annotations

from spec_decode.methods import register
from spec_decode.methods.eagle import EagleMethod


@register
class MtpMethod(EagleMethod):
    name = "mtp"
    shares_head_with = "eagle"
