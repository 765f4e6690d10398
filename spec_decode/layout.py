"""Per-method drafter layouts: the rows one request adds to each drafter forward pass.

This is DESIGN.md §1's cost table in code. The scheduler asks it what to charge; the
runner never uses it to count (it counts the rows it really built), so a mistake here
shows up as a `BudgetInvariantError` rather than as an out-of-bounds write.

Every layout answers for one request with n scheduled tokens that proposes k drafts
this step (k = 0: it does not sample, or its k was cut to 0).

Model-based methods that draft autoregressively (eagle, mtp, draft_model) run k - 1
more passes of one row per drafting request after their first pass. Those passes are
never charged: each drafting request has n >= 1 rows in the first pass, so a one-row
pass is never wider than the first and can never exceed its budget.
"""

from __future__ import annotations

from abc import ABC
from typing import ClassVar

from spec_decode.config import SpeculativeConfig


class DrafterLayout(ABC):
    """Rows per drafter pass, and KV slots written past the chunk, for one request.

    Each pass holds either the request's n context rows plus a few extra rows, or
    only extra rows (DFlash's query block); the extras depend on k alone and are 0
    when k = 0. Splitting the two lets the scheduler bound a chunk in one step.
    """

    method: ClassVar[str]
    pass_names: ClassVar[tuple[str, ...]] = ()
    # Per pass: does it carry the chunk's n context rows?
    context_passes: ClassVar[tuple[bool, ...]] = ()

    def extra_rows(self, k: int) -> tuple[int, ...]:
        """Rows beyond the context rows that proposing k drafts adds to each pass."""
        return tuple(0 for _ in self.pass_names)

    def rows(self, n: int, k: int) -> tuple[int, ...]:
        """Rows this request puts in each pass of `pass_names`, in that order."""
        return tuple(
            (n if context else 0) + extra
            for context, extra in zip(self.context_passes, self.extra_rows(k))
        )

    def lookahead_slots(self, k: int) -> int:
        """KV slots the drafter writes beyond the chunk's last position this step."""
        return 0


class NoModelLayout(DrafterLayout):
    """ngram: drafts come from token lookups, no forward pass at all."""

    method = "ngram"


class SuffixLayout(NoModelLayout):
    method = "suffix"


class EagleLayout(DrafterLayout):
    """Shifted inputs: the first pass has exactly the target's n rows."""

    method = "eagle"
    pass_names = ("draft",)
    context_passes = (True,)

    def lookahead_slots(self, k: int) -> int:
        # The k - 1 follow-up steps each write one position past the chunk.
        return max(k - 1, 0)


class MtpLayout(EagleLayout):
    method = "mtp"


class DraftModelLayout(DrafterLayout):
    """Independent small model: its n rows plus the bonus token just sampled."""

    method = "draft_model"
    pass_names = ("draft",)
    context_passes = (True,)

    def extra_rows(self, k: int) -> tuple[int, ...]:
        return (1 if k > 0 else 0,)

    def lookahead_slots(self, k: int) -> int:
        # The bonus position, then k - 1 more draft positions.
        return k


class ParallelLayout(DrafterLayout):
    """P-EAGLE: shifted inputs plus k - 1 mask rows, all drafts in one pass."""

    method = "parallel"
    pass_names = ("draft",)
    context_passes = (True,)

    def extra_rows(self, k: int) -> tuple[int, ...]:
        return (max(k - 1, 0),)

    def lookahead_slots(self, k: int) -> int:
        return max(k - 1, 0)


class PardLayout(DrafterLayout):
    """PARD: k mask rows appended to the n context rows, one pass."""

    method = "pard"
    pass_names = ("draft",)
    context_passes = (True,)

    def extra_rows(self, k: int) -> tuple[int, ...]:
        return (k,)

    def lookahead_slots(self, k: int) -> int:
        return k


class DflashLayout(DrafterLayout):
    """DFlash: context rows in one pass, a separate k + 1 row query block."""

    method = "dflash"
    pass_names = ("context", "query")
    context_passes = (True, False)

    def extra_rows(self, k: int) -> tuple[int, ...]:
        return (0, k + 1 if k > 0 else 0)

    def lookahead_slots(self, k: int) -> int:
        # The query block: the bonus token and k mask positions.
        return k + 1 if k > 0 else 0


_LAYOUTS: dict[str, type[DrafterLayout]] = {
    cls.method: cls
    for cls in (NoModelLayout, SuffixLayout, EagleLayout, MtpLayout, DraftModelLayout,
                ParallelLayout, PardLayout, DflashLayout)
}


def get_layout(config: SpeculativeConfig | None) -> DrafterLayout | None:
    """The layout of the configured method; None when speculation is off."""
    if config is None:
        return None
    return _LAYOUTS[config.method]()


def min_decode_rows(config: SpeculativeConfig) -> dict[str, int]:
    """Rows of each pass for one decoding request verifying and proposing all K drafts.

    `max_num_batched_tokens` below the largest of these cannot serve even one request
    at full speculation, so the scheduler refuses it at start.
    """
    k = config.num_speculative_tokens
    layout = _LAYOUTS[config.method]()
    rows = {"target": 1 + k}
    rows.update(zip(layout.pass_names, layout.rows(1 + k, k)))
    return rows
