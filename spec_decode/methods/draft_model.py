"""draft_model: an independent small LM of the same tokenizer.

  pass   start  rows (k>0 / k=0)  real tokens    masks  drafts read at
  draft  c      n + 1 / n         L + 1 (bonus)  0      L, then k - 1 one-row steps
"""

from __future__ import annotations

from spec_decode.methods import register
from spec_decode.methods.base import PassRecipe, SpecMethod


@register
class DraftModelMethod(SpecMethod):
    name = "draft_model"
    option_names = ("mask_token_id", "min_draft_confidence", "draft_top_k")
    drafter = "lm"
    recipes = (PassRecipe("draft", bonus=True, reads="one"),)
    sequential = True

    def extra_rows(self, k: int) -> tuple[int, ...]:
        return (1 if k > 0 else 0,)

    def lookahead_slots(self, k: int) -> int:
        # The bonus position, then k - 1 more draft positions.
        return k
