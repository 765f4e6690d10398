"""One speculative method in one place: what it costs, how its passes are built, and
how its proposer is made.

A method answers two questions, on purpose in two independent ways:

- the **cost table** (`extra_rows`, `lookahead_slots`): what the scheduler charges for
  one request that is scheduled n tokens and proposes k drafts (DESIGN.md §1);
- the **recipes** (`recipes`, `sequential`): how the runner assembles each drafter pass
  row by row (`spec_decode/passes.py`), from which it counts the rows it really built.

The runner checks one against the other every step (`runner/invariant.py`), so a
mistake in either is a `BudgetInvariantError` before any buffer write, never an
out-of-bounds read. Keep them separate: deriving one from the other would make that
check compare a number with itself.

The class answers the rest too, so the engine keeps no per-method list elsewhere: the
drafter kind the runner builds (`drafter`, through the factory table in
runner/drafters.py), how its head trains (`train_layout`, training/layouts.py) and
whose trained head it may serve with (`shares_head_with`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

import numpy as np

if TYPE_CHECKING:
    from spec_decode.proposer import TokenProposer
    from spec_decode.settings import MethodSettings
    from spec_decode.tree_shape import TreeShape


IntLike = TypeVar("IntLike", int, np.ndarray)


@dataclass(frozen=True)
class PassRecipe:
    """How one drafter pass lays out one request's rows (positions are contiguous).

    Segments, in order: the chunk's n context rows (`context`), then, only for a
    request that drafts (k >= 1), the bonus token's row (`bonus`) and k + `masks`
    mask rows (`masks` None: no mask rows). After verification the context segment
    holds L real tokens then n - L padding rows, and the padding moves to the end.
    A pass without context rows starts at the bonus position, c + L.
    """

    name: str
    context: bool = True
    bonus: bool = False
    masks: int | None = None
    shift: int = 0  # 1: the row at position p carries the token at p + 1 (EAGLE)
    conditioned: bool = False  # context rows read the target's hidden state
    reads: str = "none"  # drafts read here: "none", "one" (then sequential), "all" (k)
    read_skip: int = 0  # rows past the bonus token's row where reading starts


@dataclass(frozen=True)
class TrainLayout:
    """How a head method's serving passes unroll into training steps (training/layouts.py
    explains each field against the passes; the training maths is there, in torch)."""

    token_shift: int  # a context row at p carries the token at p + token_shift
    later: str  # kind of the steps after the context step: "feedback" or "mask"
    bonus: bool  # a bonus-token step (mask_hidden, its own token) follows the context
    label_offset: int  # a row at r predicts labels[r + label_offset]

    def steps(self, depth: int) -> list[str]:
        """Every step's kind for `depth` drafts (K)."""
        if self.bonus:
            return ["context", "bonus", *[self.later] * depth]
        return ["context", *[self.later] * (depth - 1)]

    @property
    def first_loss_step(self) -> int:
        return 2 if self.bonus else 0


class SpecMethod:
    """Base class; one subclass per method, registered by name (methods/__init__.py)."""

    name: ClassVar[str]
    # The drafter kind the runner builds through its factory table (runner/drafters.py):
    # "lookup" (a token proposer, `make_proposer`), "head" (a target-conditioned head)
    # or "lm" (an independent draft LM). A kind is a string, not an import: spec_decode
    # sits below the runner.
    drafter: ClassVar[str] = "lookup"
    # How `specbudget train-drafter` unrolls this method's head; None: not trainable.
    train_layout: ClassVar[TrainLayout | None] = None
    # How `train-drafter --init` starts its head when not given: "target" (the decoder
    # layer as the target's layer whose input it reads last) or "random".
    train_init: ClassVar[str] = "target"
    # A method whose trained head this one serves with when none was trained for it
    # (the same serving layout), looked for after its own.
    shares_head_with: ClassVar[str | None] = None
    recipes: ClassVar[tuple[PassRecipe, ...]] = ()
    # After the first pass, k - 1 one-row steps per drafting request feed each new
    # draft back. Never charged: one row never exceeds the n >= 1 of the first pass.
    sequential: ClassVar[bool] = False
    # Whether a parked request's draft is proposed all the same, for the goodput policy
    # to check against the token the request samples next (`SchedulerOutput.
    # shadow_req_ids`): for a proposer that costs microseconds and no forward rows
    # (ngram: 3-6 us a request). A parked request otherwise learns nothing until its
    # record fades, and ngram's acceptance comes in runs (measured on held-out chat at 4
    # running: fixed K = 1 accepted 0.58 of first drafts after an acceptance, 0.22 after
    # a rejection; goodput, parked after a rejection, missed the runs that followed).
    # Not suffix: its first proposal builds the request's tree (~2.7 ms per 80 tokens).
    shadows: ClassVar[bool] = False
    # The `SpeculativeConfig.options` keys this method's proposer or drafter reads;
    # any other key is refused, so a misspelt setting is never silently ignored.
    option_names: ClassVar[tuple[str, ...]] = ()
    # The trees it drafts (spec_decode/tree_shape.py); None: chains of k. A tree's
    # passes are sized by its depth, not its k (`drafting_trees`).
    tree: TreeShape | None = None

    def drafting_trees(self, shape: TreeShape) -> SpecMethod:
        """This method drafting trees of `shape`: a list of k drafts is
        `shape.depth(k)` deep, and the cost table and the recipes' mask rows, reads and
        one-row steps follow that depth (its leaves cost target rows only)."""
        if shape.is_chain:
            return self
        tree = copy.copy(self)
        tree.tree = shape
        return tree

    def depth(self, k: IntLike) -> IntLike:
        """How deep a list of k drafts goes: k for a chain."""
        return k if self.tree is None else self.tree.depth(k)

    @property
    def pass_names(self) -> tuple[str, ...]:
        return tuple(recipe.name for recipe in self.recipes)

    @property
    def context_passes(self) -> tuple[bool, ...]:
        return tuple(recipe.context for recipe in self.recipes)

    @property
    def parks(self) -> bool:
        """Whether a request that samples and proposes no draft (k = 0) is parked: it
        puts no rows in the context passes, so a step where nobody drafts runs no
        drafter pass at all. Its drafter (a head or a draft LM, which keeps its own KV
        over the context) falls behind, and catches up when it next drafts
        (`context_rows`). Lookup methods run no pass to skip."""
        return self.drafter != "lookup" and any(self.context_passes)

    @property
    def trained_heads(self) -> tuple[str, ...]:
        """The methods whose trained head this one may serve with, in lookup order."""
        shared = (self.shares_head_with,) if self.shares_head_with else ()
        return (self.name, *shared)

    # ---- the cost table (what the scheduler charges) -----------------------------

    def extra_rows(self, k: int) -> tuple[int, ...]:
        """Rows beyond the n context rows that proposing k drafts adds to each pass (k
        a chain's drafts: a tree's depth, `rows` and `slots_ahead` convert)."""
        return tuple(0 for _ in self.recipes)

    def rows(self, n: int, k: int, context: int | None = None) -> tuple[int, ...]:
        """Rows one request puts in each pass of `pass_names`, in that order; `context`:
        its rows in the context passes when not n (`context_rows`)."""
        ctx = n if context is None else context
        return tuple((ctx if recipe.context else 0) + extra
                     for recipe, extra in zip(self.recipes, self.extra_rows(self.depth(k))))

    def lookahead_slots(self, k: int) -> int:
        """KV slots the drafter writes beyond the chunk's last position this step, for
        a chain of k drafts."""
        return 0

    def slots_ahead(self, k: int) -> int:
        """`lookahead_slots` for a list of k drafts (a tree's depth)."""
        return self.lookahead_slots(self.depth(k))

    # ---- the proposer --------------------------------------------------------------

    def make_proposer(self, config: MethodSettings) -> TokenProposer:
        """The token-lookup proposer (ngram, suffix) of a "lookup" drafter; model methods
        draft in the runner through the network their `drafter` kind names."""
        raise TypeError(f"method {self.name!r} drafts with a {self.drafter!r} drafter in the "
                        "runner, not with a token proposer")


def context_rows(parks: bool, n: IntLike, k: IntLike, behind: IntLike,
                 samples: IntLike) -> IntLike:
    """Rows each request puts in a context pass: its chunk, after the `behind` rows its
    drafter skipped while parked (positions [c - behind, c), whose target features
    wait in the drafter's feature cache); none while parked (it samples with k = 0,
    under a method that `parks`). The one rule the scheduler charges by and the
    runner builds by; each keeps its own count of `behind`, so a drift between them
    is a refused step (runner/invariant.py). Ints or arrays alike (a product for
    "and", so one request's charge costs no numpy call)."""
    if not parks:
        return n
    parked = samples * (k == 0)
    return (n + behind) * (1 - parked)
