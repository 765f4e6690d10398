"""pard (PARD): an independent draft LM with k mask rows after the context, one pass.
The bonus token's row is the first of the k rows that read drafts.

  pass   start  rows (k>0 / k=0)  real tokens    masks  drafts read at
  draft  c      n + k / n         L + 1 (bonus)  k - 1  L .. L + k - 1
"""

from __future__ import annotations

from spec_decode.methods import register
from spec_decode.methods.base import PassRecipe, SpecMethod


@register
class PardMethod(SpecMethod):
    name = "pard"
    option_names = ("mask_token_id",)
    drafter = "lm"
    recipes = (PassRecipe("draft", bonus=True, masks=-1, reads="all"),)

    def extra_rows(self, k: int) -> tuple[int, ...]:
        return (k,)

    def lookahead_slots(self, k: int) -> int:
        return k
