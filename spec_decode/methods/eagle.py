"""eagle: a head conditioned on the target's hidden states, fed shifted inputs.

  pass   start  rows (k>0 / k=0)  real tokens   masks  drafts read at
  draft  c      n / n             L (shifted)   0      L - 1, then k - 1 one-row steps

"Shifted": the row at position p pairs the target's hidden state at p with the token
at p + 1, so the first pass has exactly the target's n rows.
"""

from __future__ import annotations

from spec_decode.methods import register
from spec_decode.methods.base import PassRecipe, SpecMethod, TrainLayout


@register
class EagleMethod(SpecMethod):
    name = "eagle"
    option_names = ("seed", "mask_token_id", "min_draft_confidence", "draft_top_k")
    drafter = "head"
    recipes = (PassRecipe("draft", shift=1, conditioned=True, reads="one"),)
    sequential = True
    # Training feeds each step's own output back, as the k - 1 one-row steps do.
    train_layout = TrainLayout(token_shift=1, later="feedback", bonus=False, label_offset=1)

    def extra_rows(self, k: int) -> tuple[int, ...]:
        return (0,)

    def lookahead_slots(self, k: int) -> int:
        # The k - 1 follow-up steps each write one position past the chunk.
        return max(k - 1, 0)
