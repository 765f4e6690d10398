"""The shape of a drafted token tree: how many candidates each depth lists.

A request's drafts are listed depth by depth: at depth d, first the chain's draft (the
drafter's greedy token, fed on to depth d + 1), then `width(d) - 1` more candidates as
leaves (runner/draft_tree.py verifies them). Widths (4, 2) list

    [a1, b1, c1, d1, a2, b2, a3, b3, ...]   depth 1: 4, then 2 at every depth after

so a list of any length k is a tree (its first `depth(k)` depths, the last perhaps
cut short), and K, the longest list, counts every node (as vLLM's token trees do).
No torch: the scheduler's cost table reads the depth of a list too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

IntLike = TypeVar("IntLike", int, np.ndarray)


def tree_nodes(widths: tuple[int, ...] | list[int], depth: int) -> int:
    """K of a tree `depth` deep: its widths summed, the last repeating."""
    return sum(widths[min(d, len(widths) - 1)] for d in range(depth))


@dataclass(frozen=True)
class TreeShape:
    """Candidates per depth (`widths[d - 1]`; the last holds for every deeper one), for
    lists of at most `max_entries` drafts."""

    widths: tuple[int, ...]
    max_entries: int
    # [depths + 1]: the list index where each depth starts, then one past the last.
    starts: np.ndarray = field(init=False, repr=False, compare=False)
    # The depth of each leaf among `max_entries` list entries, leaves in list order.
    leaf_depth: np.ndarray = field(init=False, repr=False, compare=False)
    # One candidate a depth (asked on every step: kept, not recounted).
    is_chain: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.widths or min(self.widths) < 1:
            raise ValueError(f"a tree lists at least one candidate a depth, got {self.widths}")
        starts = [0]
        while starts[-1] < self.max_entries:
            starts.append(starts[-1] + self.width(len(starts)))
        # Depth d's leaves: its width less its chain draft.
        leaves = np.repeat(np.arange(1, len(starts)),
                           [self.width(d) - 1 for d in range(1, len(starts))])
        object.__setattr__(self, "starts", np.asarray(starts, dtype=np.int64))
        object.__setattr__(self, "leaf_depth", leaves[:self.max_entries].astype(np.int64))
        object.__setattr__(self, "is_chain", all(width == 1 for width in self.widths))

    def width(self, depth: int) -> int:
        """Candidates listed at `depth` (1-based)."""
        return self.widths[min(depth, len(self.widths)) - 1]

    def readout_widths(self, reqs: list[int]) -> list[int]:
        """Candidates listed at each of a pass's readout rows (row i a depth of request
        `reqs[i]`), where a request's rows read its depths in order from the first:
        reqs [4, 4, 4, 7] read depths [1, 2, 3, 1]."""
        order = np.asarray(reqs)
        index = np.arange(len(order))
        first = np.ones(len(order), dtype=bool)
        first[1:] = order[1:] != order[:-1]
        depth = index - np.maximum.accumulate(np.where(first, index, 0)) + 1
        widths = np.asarray(self.widths)[np.minimum(depth, len(self.widths)) - 1]
        return [int(w) for w in widths]

    def depth(self, k: IntLike) -> IntLike:
        """How deep a list of k drafts goes (k for a chain)."""
        if self.is_chain:
            return k
        found = np.searchsorted(self.starts, k, side="left")
        return int(found) if isinstance(k, int | np.integer) else found

    def nodes(self, depth: IntLike) -> IntLike:
        """List entries of a tree `depth` deep (its node count; depth for a chain)."""
        if self.is_chain:
            return depth
        found = self.starts[np.minimum(depth, len(self.starts) - 1)]
        return int(found) if isinstance(depth, int | np.integer) else found

    def chain_of(self, drafts: list[int]) -> list[int]:
        """The chain's drafts: each depth's first."""
        if self.is_chain:
            return drafts
        return [drafts[int(i)] for i in self.starts[:self.depth(len(drafts))]]

    def row_order(self, drafts: list[int]) -> list[int]:
        """The list in target-pass row order: the chain, then the leaves in list order."""
        if self.is_chain:
            return drafts
        firsts = set(self.starts[:self.depth(len(drafts))].tolist())
        return self.chain_of(drafts) + [t for i, t in enumerate(drafts) if i not in firsts]

    def leaves_at(self, drafts: list[int], depth: int) -> tuple[int, list[int]]:
        """(list index of the first, the leaves) a list holds at `depth`."""
        first = int(self.starts[depth - 1]) + 1
        return first, drafts[first:int(self.starts[depth])]

    def leaf_ordinal(self, index: int) -> int:
        """A leaf's place among the list's leaves (list order), from its list index."""
        return index - self.depth(index + 1)
