"""Drafted token trees (runner/draft_tree.py): layout, leaf matching, compaction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.draft_tree import (
    chain_of,
    compact,
    leaf_depths,
    match_leaves,
    row_order,
    tree_positions,
)


def test_rows_hold_the_chain_then_the_leaves() -> None:
    listed = [10, 11, 20, 21, 30]  # a1 b1 a2 b2 a3 (T = 2)
    assert chain_of(listed, 2) == [10, 20, 30]
    assert row_order(listed, 2) == [10, 20, 30, 11, 21]
    three = [10, 11, 12, 20, 21]  # a1 b1 c1 a2 b2 (T = 3)
    assert row_order(three, 3) == [10, 20, 11, 12, 21]
    assert row_order(listed, 1) == listed


@pytest.mark.parametrize(("top_k", "num", "depths"), [
    (2, 5, [0, 0, 0, 1, 2]),  # a1 a2 a3 | b1 b2
    (2, 6, [0, 0, 0, 1, 2, 3]),
    (3, 5, [0, 0, 1, 1, 2]),  # a1 a2 | b1 c1 b2
    (3, 7, [0, 0, 0, 1, 1, 2, 2]),
    (2, 1, [0]),
])
def test_each_leaf_knows_its_depth(top_k: int, num: int, depths: list[int]) -> None:
    index = np.arange(num)
    assert leaf_depths(np.full(num, num), index, top_k).tolist() == depths
    # Its depth is the one its list entry holds.
    listed = list(range(num))
    ordered = row_order(listed, top_k)
    assert [0 if i % top_k == 0 else i // top_k + 1 for i in ordered] == depths


def test_a_leaf_takes_its_chain_draft_s_position_and_prefix() -> None:
    """Request rows t0 a1 a2 a3 b1 b2 from position 7 (T = 2, five drafts), after a
    row of another request."""
    positions = np.array([3, 7, 8, 9, 10, 11, 12])
    drafts = np.array([0, 5, 5, 5, 5, 5, 5])
    index = np.array([-1, -1, 0, 1, 2, 3, 4])
    moved, prefix = tree_positions(positions, drafts, index, 2)
    assert moved.tolist() == [3, 7, 8, 9, 10, 8, 9]
    assert prefix.tolist() == [-1, -1, -1, -1, -1, 8, 9]


def test_a_recovered_token_that_matches_a_leaf_names_its_rows() -> None:
    # Request 0: a1 accepted, a2 rejected, recovered 21 = b2. Request 1: a1 rejected,
    # recovered 99, no leaf. Request 2: the whole chain accepted, then a bonus.
    # Request 3 (T = 2, drafts a1 b1): a1 rejected, recovered 11 = b1.
    drafts = [[10, 11, 20, 21, 30, 31], [10, 11], [10, 11, 20], [10, 11]]
    emitted = [[10, 21], [99], [10, 20, 5], [11]]
    hits = match_leaves(emitted, drafts, 2, [1, 20, 30, 40])
    assert hits.sampling_index == [0, 3]
    # Request 0's rows from 1: a1 a2 a3 (1-3), b1 b2 b3 (4-6): b2 at 5 replaces a2 at 2.
    assert hits.leaf_rows == [5, 41] and hits.chain_rows == [2, 40]


def test_top_three_leaves_are_matched_by_rank() -> None:
    drafts = [[10, 11, 12, 20, 21, 22]]  # rows a1 a2 | b1 c1 b2 c2
    hits = match_leaves([[10, 22]], drafts, 3, [0])
    assert hits.leaf_rows == [5] and hits.chain_rows == [1]
    assert not match_leaves([[10, 20, 7]], drafts, 3, [0]).leaf_rows


def test_compaction_moves_the_leaf_s_kv_and_features_only() -> None:
    caches = [(torch.arange(48.).view(4, 2, 3, 2), torch.arange(48.).view(4, 2, 3, 2) + 100)
              for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    slots = torch.tensor([6, 1, 4, 2, 7])  # rows 0-4 at these cache slots
    features = torch.arange(10.).view(5, 2)
    # Rows t0 a1 a2 b1 b2 from 0: a2 rejected, recovered 21 = b2 (row 4 -> a2's row 2).
    hits = match_leaves([[9, 21]], [[9, 8, 20, 21]], 2, [1])
    assert hits.leaf_rows == [4] and hits.chain_rows == [2]
    compact(caches, slots, features, hits)
    for (key, value), (key0, value0) in zip(caches, before, strict=True):
        for cache, old in ((key, key0), (value, value0)):
            flat, flat_old = cache.view(-1, 3, 2), old.view(-1, 3, 2)
            assert torch.equal(flat[4], flat_old[7])  # row 2's slot <- row 4's slot
            others = [s for s in range(8) if s != 4]
            assert torch.equal(flat[others], flat_old[others])
    assert features[2].tolist() == [8.0, 9.0] and features[4].tolist() == [8.0, 9.0]
    assert features[[0, 1, 3]].tolist() == [[0.0, 1.0], [2.0, 3.0], [6.0, 7.0]]


@pytest.mark.parametrize(("method", "target", "passes", "ahead"), [
    ("eagle", 7, {"draft": 7}, 2),  # a chain of 3 deep: two one-row steps ahead
    ("parallel", 7, {"draft": 7 + 2}, 2),  # depth - 1 mask rows
    ("dflash", 7, {"context": 7, "query": 3 + 1}, 4),  # the bonus and depth masks
])
def test_a_tree_s_passes_follow_its_depth(method: str, target: int, passes: dict[str, int],
                                          ahead: int) -> None:
    """Six drafts in trees of two: three deep. The target verifies all six (1 + 6 rows);
    the drafter's mask rows, reads and lookahead slots are those of a chain of three,
    in the scheduler's cost table and in the runner's assembled rows alike."""
    from spec_decode import SpeculativeConfig
    from spec_decode.config import min_decode_rows
    from spec_decode.passes import plan_step_rows

    spec = SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 6,
                                        "draft_top_k": 2, "draft_policy": "fixed"})
    assert spec is not None
    tree = spec.spec_method
    assert tree.depth(6) == 3 and tree.depth(5) == 3 and tree.depth(1) == 1
    assert min_decode_rows(spec) == {"target": target, **passes}
    assert tree.slots_ahead(6) == ahead
    built = plan_step_rows(tree, np.array([7]), np.array([6]))
    assert {name: rows for name, rows in built.counts.items()
            if not name.startswith("step_")} == {"target": 7, **passes}
    assert [rows.reads.tolist() for rows in built.passes][-1] == [1 if method == "eagle" else 3]
    # The chain method's registered singleton is untouched.
    from spec_decode import get_method

    assert get_method(method).depth(6) == 6
