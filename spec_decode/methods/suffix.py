"""suffix: drafts from a suffix tree over the request's tokens and earlier responses.
No forward pass, so no drafter rows and no KV slots past the chunk."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spec_decode.methods import register
from spec_decode.methods.base import SpecMethod

if TYPE_CHECKING:
    from spec_decode.proposer import TokenProposer
    from spec_decode.settings import MethodSettings


@register
class SuffixMethod(SpecMethod):
    name = "suffix"
    option_names = ("max_tree_depth", "max_cached_requests", "min_token_prob", "max_spec_factor")

    def make_proposer(self, config: MethodSettings) -> TokenProposer:
        from spec_decode.suffix import SuffixProposer

        return SuffixProposer.from_config(config)
