"""parallel (P-EAGLE): eagle's shifted inputs plus k - 1 mask rows, every draft in one
pass.

  pass   start  rows (k>0 / k=0)  real tokens  masks  drafts read at
  draft  c      n + k - 1 / n     L (shifted)  k - 1  L - 1 .. L + k - 2
"""

from __future__ import annotations

from spec_decode.methods import register
from spec_decode.methods.base import PassRecipe, SpecMethod, TrainLayout


@register
class ParallelMethod(SpecMethod):
    name = "parallel"
    option_names = ("seed", "mask_token_id", "draft_top_k")
    drafter = "head"
    recipes = (PassRecipe("draft", masks=-1, shift=1, conditioned=True, reads="all"),)
    train_layout = TrainLayout(token_shift=1, later="mask", bonus=False, label_offset=1)

    def extra_rows(self, k: int) -> tuple[int, ...]:
        return (max(k - 1, 0),)

    def lookahead_slots(self, k: int) -> int:
        return max(k - 1, 0)
