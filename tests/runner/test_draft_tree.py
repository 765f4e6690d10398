"""Drafted token trees (runner/draft_tree.py): layout, leaf matching, compaction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.draft_tree import (
    LeafLogits,
    compact,
    leaf_logits_up_front,
    match_leaves,
    tree_positions,
)
from spec_decode.tree_shape import TreeShape, tree_nodes


def shape(*widths: int, entries: int = 16) -> TreeShape:
    return TreeShape(widths, entries)


def test_rows_hold_the_chain_then_the_leaves() -> None:
    listed = [10, 11, 20, 21, 30]  # a1 b1 a2 b2 a3 (T = 2)
    assert shape(2).chain_of(listed) == [10, 20, 30]
    assert shape(2).row_order(listed) == [10, 20, 30, 11, 21]
    three = [10, 11, 12, 20, 21]  # a1 b1 c1 a2 b2 (T = 3)
    assert shape(3).row_order(three) == [10, 20, 11, 12, 21]
    assert shape(1).row_order(listed) == listed and shape(1).chain_of(listed) == listed
    # Widths per depth: 3 at the first, 2 after: a1 b1 c1 a2 b2 a3 b3.
    wide = [10, 11, 12, 20, 21, 30, 31]
    assert shape(3, 2).chain_of(wide) == [10, 20, 30]
    assert shape(3, 2).row_order(wide) == [10, 20, 30, 11, 12, 21, 31]


@pytest.mark.parametrize(("widths", "k", "depth"), [
    ((2,), 5, 3), ((2,), 6, 3), ((3,), 5, 2), ((3,), 7, 3), ((2,), 1, 1), ((1,), 5, 5),
    ((4, 2), 4, 1), ((4, 2), 5, 2), ((4, 2), 7, 3), ((4, 2, 1), 8, 4), ((2,), 0, 0),
])
def test_a_list_s_depth(widths: tuple[int, ...], k: int, depth: int) -> None:
    tree = shape(*widths)
    assert tree.depth(k) == depth
    assert tree.depth(np.array([k, k])).tolist() == [depth, depth]
    assert len(tree.chain_of(list(range(k)))) == depth


def test_a_leaf_takes_its_chain_draft_s_position_and_prefix() -> None:
    """Request rows t0 a1 a2 a3 b1 b2 from position 7 (T = 2, five drafts), after a
    row of another request."""
    positions = np.array([3, 7, 8, 9, 10, 11, 12])
    drafts = np.array([0, 5, 5, 5, 5, 5, 5])
    index = np.array([-1, -1, 0, 1, 2, 3, 4])
    moved, prefix = tree_positions(positions, drafts, index, shape(2))
    assert moved.tolist() == [3, 7, 8, 9, 10, 8, 9]
    assert prefix.tolist() == [-1, -1, -1, -1, -1, 8, 9]
    # Widths (3, 2), six drafts a1 b1 c1 a2 b2 a3: rows a1 a2 a3 | b1 c1 b2.
    moved, prefix = tree_positions(np.arange(7, 14), np.full(7, 6), np.arange(-1, 6),
                                   shape(3, 2))
    assert moved.tolist() == [7, 8, 9, 10, 8, 8, 9]
    assert prefix.tolist() == [-1, -1, -1, -1, 8, 8, 9]


def test_a_recovered_token_that_matches_a_leaf_names_its_rows() -> None:
    # Request 0: a1 accepted, a2 rejected, recovered 21 = b2. Request 1: a1 rejected,
    # recovered 99, no leaf. Request 2: the whole chain accepted, then a bonus.
    # Request 3 (T = 2, drafts a1 b1): a1 rejected, recovered 11 = b1.
    drafts = [[10, 11, 20, 21, 30, 31], [10, 11], [10, 11, 20], [10, 11]]
    emitted = [[10, 21], [99], [10, 20, 5], [11]]
    hits = match_leaves(emitted, drafts, shape(2), [1, 20, 30, 40])
    assert hits.sampling_index == [0, 3]
    # Request 0's rows from 1: a1 a2 a3 (1-3), b1 b2 b3 (4-6): b2 at 5 replaces a2 at 2.
    assert hits.leaf_rows == [5, 41] and hits.chain_rows == [2, 40]


def test_leaves_are_matched_by_rank_and_depth() -> None:
    drafts = [[10, 11, 12, 20, 21, 22]]  # rows a1 a2 | b1 c1 b2 c2
    hits = match_leaves([[10, 22]], drafts, shape(3), [0])
    assert hits.leaf_rows == [5] and hits.chain_rows == [1]
    assert not match_leaves([[10, 20, 7]], drafts, shape(3), [0]).leaf_rows
    # Widths (3, 2): a1 b1 c1 a2 b2 a3 b3 -> rows a1 a2 a3 | b1 c1 b2 b3; c1 at row 4.
    wide = [[10, 11, 12, 20, 21, 30, 31]]
    hits = match_leaves([[12]], wide, shape(3, 2), [0])
    assert hits.leaf_rows == [4] and hits.chain_rows == [0]
    hits = match_leaves([[10, 20, 31]], wide, shape(3, 2), [0])
    assert hits.leaf_rows == [6] and hits.chain_rows == [2]


def test_compaction_moves_the_leaf_s_kv_and_features_only() -> None:
    caches = [(torch.arange(48.).view(4, 2, 3, 2), torch.arange(48.).view(4, 2, 3, 2) + 100)
              for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    slots = torch.tensor([6, 1, 4, 2, 7])  # rows 0-4 at these cache slots
    features = torch.arange(10.).view(5, 2)
    # Rows t0 a1 a2 b1 b2 from 0: a2 rejected, recovered 21 = b2 (row 4 -> a2's row 2).
    hits = match_leaves([[9, 21]], [[9, 8, 20, 21]], shape(2), [1])
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


@pytest.mark.parametrize(("num_logits", "leaves", "per_call", "up_front"), [
    (5, 4, 32, 4),  # one request's [4, 2, 1]: 9 rows, one call either way
    (28, 4, 32, 4),  # fills the call exactly
    (30, 4, 32, 0),  # would spill into a second call
    (80, 16, 32, 16),  # 3 calls either way
    (64, 4, 32, 0),  # 2 calls, then 3
    (5, 4, None, 4),  # a head with no cap (unpacked, the GPU)
    (5, 0, 32, 0),
])
def test_leaf_logits_ride_along_where_they_cost_no_call(
        num_logits: int, leaves: int, per_call: int | None, up_front: int) -> None:
    assert leaf_logits_up_front(num_logits, leaves, per_call) == up_front


def test_leaf_logits_are_found_by_row_and_copied() -> None:
    pool = LeafLogits(np.array([4, 5, 11]), torch.arange(9.).view(3, 3))
    got = pool.of([11, 4])
    assert got.tolist() == [[6.0, 7.0, 8.0], [0.0, 1.0, 2.0]]
    got.fill_(-1)  # sampling masks its copy, not the pool
    assert pool.logits[0].tolist() == [0.0, 1.0, 2.0]
    for missing in ([6], [12]):  # between rows computed, past the last
        with pytest.raises(AssertionError, match="not among those computed"):
            pool.of(missing)


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


def test_goodput_prices_a_tree_by_depth() -> None:
    """The policy's rule counts a tree's depth; its costs are the nodes' rows: a depth
    of [4, 2, 1] costs the target 4, 2, 1, 1 rows, where the chain's depths cost 1."""
    from scheduler.budget import ThrottleRule, TreeDepthRule
    from scheduler.step_cost import DraftCosts
    from spec_decode import SpeculativeConfig

    spec = SpeculativeConfig.from_dict({"method": "parallel", "num_speculative_tokens": 8,
                                        "draft_top_k": [4, 2, 1]})
    assert spec is not None
    rule = ThrottleRule(spec.spec_method, 8, 256)
    by_depth = TreeDepthRule(rule, spec.tree_shape)
    assert by_depth.max_k == 4
    costs = DraftCosts.for_rule(by_depth)
    assert costs.target.tolist() == [4, 2, 1, 1]
    # Parallel's one pass: n context rows plus depth - 1 masks, n = 1 + the nodes.
    assert costs.drafter_at.tolist() == [0, 5, 8, 10, 12]  # k = 0: parked, no rows
    assert by_depth.plan(1 + 2, 2, 2).rows == rule.plan(1 + 6, 6, 6).rows


def test_a_shape_s_leaves_and_nodes() -> None:
    """Widths (3, 2): depths start at list entries 0, 3, 5, 7; leaves in list order sit
    at depths 1, 1, 2, 3, ...; a chain has none."""
    wide = shape(3, 2, entries=8)
    assert wide.starts.tolist() == [0, 3, 5, 7, 9]
    assert wide.leaf_depth[:4].tolist() == [1, 1, 2, 3]
    assert wide.nodes(2) == 5 and wide.nodes(np.array([0, 1, 3])).tolist() == [0, 3, 7]
    assert shape(1).leaf_depth.tolist() == [] and shape(1).nodes(3) == 3
    assert [wide.leaf_ordinal(i) for i in (1, 2, 4, 6)] == [0, 1, 2, 3]
    # A config's K from its widths and depth: the nodes the shape lists to that depth.
    assert [tree_nodes((3, 2), d) for d in range(5)] == wide.starts.tolist()
    assert tree_nodes([4, 2, 1], 4) == 8 and tree_nodes((1,), 4) == 4


def test_readout_rows_list_their_depth_s_width() -> None:
    """A pass reads out each request's depths in order (a parallel or dflash head's
    several readout rows a request; an eagle step's one each)."""
    wide = shape(4, 2, 1)
    assert wide.readout_widths([4, 4, 4, 4, 7, 9, 9]) == [4, 2, 1, 1, 4, 4, 2]
    assert wide.readout_widths([]) == []
    assert shape(1).is_chain and not wide.is_chain
