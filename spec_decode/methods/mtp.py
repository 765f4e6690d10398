"""mtp: multi-token-prediction layers drafting like eagle (same passes and cost)."""

from __future__ import annotations

from spec_decode.methods import register
from spec_decode.methods.eagle import EagleMethod


@register
class MtpMethod(EagleMethod):
    name = "mtp"
