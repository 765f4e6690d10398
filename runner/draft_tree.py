"""Drafted token trees: a chain of greedy drafts plus leaves, verified in one pass.

With `draft_top_k` = T > 1 (spec_decode/config.py), a drafter lists a request's drafts
depth by depth: at depth d, first the chain's draft a_d (the drafter's greedy token,
fed on to the next depth), then the next T - 1 candidates as leaves. The list is what
the scheduler schedules and charges, so its length is K and any prefix of it is a tree.

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


def chain_of(drafts: list[int], top_k: int) -> list[int]:
    """The chain's drafts (list entries at multiples of T)."""
    return drafts[::top_k]


def row_order(drafts: list[int], top_k: int) -> list[int]:
    """The list's drafts in target-pass row order: the chain, then the leaves."""
    if top_k == 1:
        return drafts
    return drafts[::top_k] + [t for i, t in enumerate(drafts) if i % top_k]


def chain_length(num_drafts: np.ndarray, top_k: int) -> np.ndarray:
    """Chain drafts of lists of these lengths: ceil(s / T)."""
    return -(-num_drafts // top_k)


def leaf_depths(num_drafts: np.ndarray, draft_index: np.ndarray, top_k: int) -> np.ndarray:
    """The depth (1-based) of each draft row, given its index among its request's
    draft rows in row order; 0 for a chain row."""
    chain = chain_length(num_drafts, top_k)
    j = draft_index - chain  # index among the leaves
    listed = j + j // max(top_k - 1, 1) + 1  # the leaf's index in the list
    return np.where(j >= 0, listed // top_k + 1, 0)


def tree_positions(positions: np.ndarray, num_drafts: np.ndarray, draft_index: np.ndarray,
                   top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's position and tree prefix (-1 but for leaves), given its sequence
    position, its request's draft count and its index among the draft rows (negative
    for the rows before them). A leaf of depth d sits at a_d's position: its row less
    the chain rows after a_d and the leaves before it."""
    depth = np.where(draft_index >= 0, leaf_depths(num_drafts, draft_index, top_k), 0)
    leaf = depth > 0
    first_draft = positions - draft_index
    moved = np.where(leaf, first_draft + depth - 1, positions)
    return moved, np.where(leaf, moved, -1).astype(np.int32)


@dataclass
class LeafHits:
    """Requests whose recovered token matched a leaf, one entry each."""

    sampling_index: list[int]  # index among the step's sampling requests
    leaf_rows: list[int]  # the leaf's target-pass row
    chain_rows: list[int]  # the row of the chain draft it replaces (a_d's)


def match_leaves(emitted: list[list[int]], drafts: list[list[int]], top_k: int,
                 first_draft_rows: list[int]) -> LeafHits:
    """For each sampling request (its emitted tokens after the chain's walk, its draft
    list, and the target-pass row of its first draft), the leaf its recovered token
    matched, if any. A request whose chain was all accepted ends on a bonus token and
    matches nothing."""
    hits = LeafHits([], [], [])
    for j, (tokens, listed) in enumerate(zip(emitted, drafts, strict=True)):
        chain = len(chain_of(listed, top_k))
        depth = len(tokens)  # the rejected draft's depth, when one was
        if not listed or depth > chain:
            continue
        leaves = listed[(depth - 1) * top_k + 1:depth * top_k]
        if tokens[-1] not in leaves:
            continue
        listed_index = (depth - 1) * top_k + 1 + leaves.index(tokens[-1])
        # Leaves before it in row order: every non-chain list entry before it.
        before = listed_index - (listed_index // top_k + 1)
        hits.sampling_index.append(j)
        hits.leaf_rows.append(first_draft_rows[j] + chain + before)
        hits.chain_rows.append(first_draft_rows[j] + depth - 1)
    return hits


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
