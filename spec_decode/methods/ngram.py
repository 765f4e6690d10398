"""ngram (prompt lookup): drafts copied from the request's own earlier tokens. No
forward pass, so no drafter rows and no KV slots past the chunk."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spec_decode.methods import register
from spec_decode.methods.base import SpecMethod

if TYPE_CHECKING:
    from spec_decode.proposer import TokenProposer
    from spec_decode.settings import MethodSettings


@register
class NgramMethod(SpecMethod):
    name = "ngram"
    option_names = ("max_window",)
    shadows = True

    def make_proposer(self, config: MethodSettings) -> TokenProposer:
        from spec_decode.ngram import NgramProposer

        return NgramProposer.from_config(config)
