"""Drafted token trees: a chain of greedy drafts plus leaves, verified in one pass.

With `draft_top_k` (spec_decode/config.py), a drafter lists a request's drafts depth
by depth (spec_decode/tree_shape.py): at depth d, first the chain's draft a_d (the
drafter's greedy token, fed on to the next depth), then the next candidates as
leaves. The list is what the scheduler schedules and charges, so its length is K and
any prefix of it is a tree.

The target pass lays a request's draft rows out as the chain, then the leaves:

    list  [a1, b1, a2, b2, a3]  (T = 2)       rows  t0 a1 a2 a3 | b1 b2
    position                                         p  p+1 p+2 p+3 | p+1 p+2

A leaf at depth d sits at position p + d like a_d, and sees only the keys before that
position and its own (`AttentionMetadata.tree_prefix`), so it computes what a_d's row
would have computed had the drafter drafted it; the chain's rows come first, and so
cannot see any leaf.

Verification walks the chain as ever (the rejection sampler). Where a_d is rejected,
the token emitted in its place is drawn from the target's distribution at that
position (the recovered token); when it equals a leaf of depth d, that leaf's row
holds the target's distribution after it, so one more token is sampled from it. Every
emitted token is still drawn from the target's own distribution given the tokens
before it, whatever the drafts: lossless, greedy or sampled. The leaf's K/V and
features then move to a_d's slot and row (`compact`), so the cache and the drafter
see the accepted path as if the chain had drafted it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spec_decode.tree_shape import TreeShape


def tree_positions(positions: np.ndarray, num_drafts: np.ndarray, draft_index: np.ndarray,
                   shape: TreeShape) -> tuple[np.ndarray, np.ndarray]:
    """Each row's position and tree prefix (-1 but for leaves), given its sequence
    position, its request's draft count and its index among the draft rows (negative
    for the rows before them). A leaf of depth d sits at a_d's position: its row less
    the chain rows after a_d and the leaves before it."""
    chain = shape.depth(num_drafts)
    leaf = draft_index >= chain
    ordinal = np.where(leaf, draft_index - chain, 0)
    depth = np.where(leaf, shape.leaf_depth[np.minimum(ordinal, len(shape.leaf_depth) - 1)],
                     0)
    first_draft = positions - draft_index
    moved = np.where(leaf, first_draft + depth - 1, positions)
    return moved, np.where(leaf, moved, -1).astype(np.int32)


@dataclass
class LeafHits:
    """Requests whose recovered token matched a leaf, one entry each."""

    sampling_index: list[int]  # index among the step's sampling requests
    leaf_rows: list[int]  # the leaf's target-pass row
    chain_rows: list[int]  # the row of the chain draft it replaces (a_d's)


def match_leaves(emitted: list[list[int]], drafts: list[list[int]], shape: TreeShape,
                 first_draft_rows: list[int]) -> LeafHits:
    """For each sampling request (its emitted tokens after the chain's walk, its draft
    list, and the target-pass row of its first draft), the leaf its recovered token
    matched, if any. A request whose chain was all accepted ends on a bonus token and
    matches nothing."""
    hits = LeafHits([], [], [])
    for j, (tokens, listed) in enumerate(zip(emitted, drafts, strict=True)):
        chain = shape.depth(len(listed))
        depth = len(tokens)  # the rejected draft's depth, when one was
        if depth > chain:  # all accepted (an empty list too)
            continue
        first, leaves = shape.leaves_at(listed, depth)
        if tokens[-1] not in leaves:
            continue
        ordinal = shape.leaf_ordinal(first + leaves.index(tokens[-1]))
        hits.sampling_index.append(j)
        hits.leaf_rows.append(first_draft_rows[j] + chain + ordinal)
        hits.chain_rows.append(first_draft_rows[j] + depth - 1)
    return hits


def leaf_logits_up_front(num_logits: int, num_leaves: int, rows_per_call: int | None) -> int:
    """How many leaf rows get their logits in the call that computes verification's
    `num_logits` rows: all or none (then a matched leaf's are computed after
    verification). They ride along where they fit in the LM head's calls for those
    rows (`rows_per_call`, None: any number): the head streams its weight once a call,
    so on the CPU 9 rows cost what 5 do (bfloat16, 2.1-2.3 ms cold), where a matched
    leaf's own call costs as much again, in a fifth of the steps of one request
    drafting trees of [4, 2, 1]. Past a call's rows they would cost a call each step."""
    if not num_leaves or rows_per_call is None:
        return num_leaves
    calls = -(-num_logits // rows_per_call)
    return num_leaves if -(-(num_logits + num_leaves) // rows_per_call) == calls else 0


@dataclass
class LeafLogits:
    """Logits computed for leaf rows with verification's (`leaf_logits_up_front`)."""

    rows: np.ndarray  # [L] target-pass rows, ascending
    logits: torch.Tensor  # [L, V]

    def of(self, leaf_rows: list[int]) -> torch.Tensor:
        """The logits of these rows (a copy: sampling may mask it). Every row asked for
        must be one computed: a leaf of a sampling request."""
        at = np.searchsorted(self.rows, leaf_rows)
        if not (at < len(self.rows)).all() or not np.array_equal(self.rows[at], leaf_rows):
            raise AssertionError(f"leaf rows {leaf_rows} not among those computed "
                                 f"({self.rows.tolist()})")
        return self.logits[torch.as_tensor(at, device=self.logits.device)]


def compact(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor,
            features: torch.Tensor, hits: LeafHits) -> None:
    """Move each matched leaf's K/V (every layer) to the slot of the chain draft it
    replaces, and its features to that draft's row (what the drafter reads next)."""
    if not hits.leaf_rows:
        return
    device = slot_mapping.device
    src = torch.as_tensor(hits.leaf_rows, device=device)
    dst = torch.as_tensor(hits.chain_rows, device=device)
    src_slots, dst_slots = slot_mapping[src], slot_mapping[dst]
    for key_cache, value_cache in kv_caches:
        for cache in (key_cache, value_cache):
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, dst_slots, flat.index_select(0, src_slots))
    if features.numel():
        features.index_copy_(0, dst.to(features.device),
                             features.index_select(0, src.to(features.device)))
