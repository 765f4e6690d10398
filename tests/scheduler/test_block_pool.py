"""BlockPool: allocation, reference counts, the prefix-cache map and LRU eviction."""

from __future__ import annotations

import pytest

from scheduler.block_pool import BlockPool


def _ids(blocks) -> list[int]:  # type: ignore[no-untyped-def]
    return [block.block_id for block in blocks]


def test_fresh_pool_is_all_free() -> None:
    pool = BlockPool(8)
    assert pool.num_free_blocks == 8
    assert pool.usage() == 0.0
    pool.check_integrity()


def test_allocate_hands_out_distinct_blocks_with_one_reference() -> None:
    pool = BlockPool(8)
    first = pool.allocate(3)
    second = pool.allocate(2)
    assert len(first) == 3 and len(second) == 2
    assert len(set(_ids(first + second))) == 5
    assert all(block.ref_cnt == 1 for block in first + second)
    assert pool.num_free_blocks == 3
    assert pool.usage() == pytest.approx(5 / 8)
    pool.check_integrity()


def test_allocate_zero_is_a_no_op() -> None:
    pool = BlockPool(4)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_free_returns_blocks_and_usage_drops_to_zero() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(6)
    assert pool.usage() == 1.0
    assert pool.num_free_blocks == 0
    pool.free(blocks)
    assert pool.num_free_blocks == 6
    assert pool.usage() == 0.0
    assert all(block.ref_cnt == 0 for block in blocks)
    pool.check_integrity()


def test_touch_adds_references_and_free_needs_one_per_reference() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 3
    pool.check_integrity()
    pool.free([block])
    pool.free([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 3  # still held once
    pool.check_integrity()
    pool.free([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_double_free_raises() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([block])
    assert block.ref_cnt == 0
    pool.check_integrity()


def test_free_of_never_allocated_block_raises() -> None:
    pool = BlockPool(4)
    with pytest.raises(RuntimeError):
        pool.free([pool.blocks[2]])
    pool.check_integrity()


def test_integrity_holds_after_a_mix_of_operations() -> None:
    pool = BlockPool(10)
    a = pool.allocate(4)
    for i, block in enumerate(a):
        pool.cache(block, bytes([i]))
    b = pool.allocate(3)
    pool.free(reversed(a))
    pool.touch([a[0], a[1]])  # prefix hit on two cached free blocks
    c = pool.allocate(5)  # evicts some of a's remaining cached blocks
    pool.check_integrity()
    pool.free(b + c + [a[0], a[1]])
    pool.check_integrity()
    assert pool.num_free_blocks == 10


def test_integrity_catches_ref_cnt_of_free_block() -> None:
    pool = BlockPool(4)
    pool.blocks[1].ref_cnt = 1  # claims to be used but is still in the free queue
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_catches_used_block_with_zero_ref_cnt() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    block.ref_cnt = 0  # lost reference: not free, not held
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_catches_negative_ref_cnt() -> None:
    pool = BlockPool(4)
    pool.blocks[0].ref_cnt = -1
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_catches_hash_not_in_cache_map() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    block.block_hash = b"orphan"  # set behind the pool's back
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_catches_cache_map_pointing_at_wrong_block() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"h")
    a.block_hash = None  # the map still points at `a`
    with pytest.raises(AssertionError):
        pool.check_integrity()
    a.block_hash = b"h"
    pool.check_integrity()
    pool._cached[b"h"] = b  # wrong target
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_cache_registers_hash_and_lookup_finds_it() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    assert pool.lookup(b"h1") is None
    pool.cache(block, b"h1")
    assert pool.lookup(b"h1") is block
    assert block.block_hash == b"h1"
    pool.check_integrity()


def test_cache_keeps_the_first_block_for_a_hash() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    pool.cache(first, b"same")
    pool.cache(second, b"same")
    assert pool.lookup(b"same") is first
    assert second.block_hash is None
    pool.check_integrity()


def test_cache_does_not_rehash_a_cached_block() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.cache(block, b"one")
    pool.cache(block, b"two")
    assert block.block_hash == b"one"
    assert pool.lookup(b"one") is block
    assert pool.lookup(b"two") is None
    pool.check_integrity()


def test_cache_is_a_no_op_when_caching_disabled() -> None:
    pool = BlockPool(4, enable_caching=False)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h")
    assert pool.lookup(b"h") is None
    assert block.block_hash is None
    pool.check_integrity()


def test_freed_cached_block_still_hits_until_reallocated() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h")
    pool.free([block])
    assert pool.lookup(b"h") is block  # lazy eviction: free but still cached
    assert pool.usage() == 0.0  # cached-but-free counts as free
    pool.allocate(2)  # takes every free block, so `block` is evicted
    assert pool.lookup(b"h") is None
    assert block.block_hash is None
    pool.check_integrity()


def test_lru_evicts_oldest_freed_block_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for block in blocks:
        pool.cache(block, f"h{block.block_id}".encode())
    # Free in the order 2, 0, 3, 1: that is the eviction order.
    order = [blocks[2], blocks[0], blocks[3], blocks[1]]
    for block in order:
        pool.free([block])
    for i, expected in enumerate(order):
        (taken,) = pool.allocate(1)
        assert taken is expected
        # Everything freed after `expected` is still cached.
        for later in order[i + 1:]:
            assert pool.lookup(f"h{later.block_id}".encode()) is later
        assert pool.lookup(f"h{expected.block_id}".encode()) is None
    pool.check_integrity()


def test_free_order_within_one_call_sets_eviction_order() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.free(reversed([a, b, c]))  # tail first: c is evicted first
    assert _ids(pool.allocate(3)) == [c.block_id, b.block_id, a.block_id]


def test_touched_block_leaves_free_queue_and_is_not_evicted() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache(block, h)
    pool.free([a, b, c])
    pool.touch([a])  # prefix hit on the oldest free block
    assert a.ref_cnt == 1
    assert pool.num_free_blocks == 2
    pool.check_integrity()
    taken = pool.allocate(2)
    assert a not in taken
    assert pool.lookup(b"a") is a
    assert pool.lookup(b"b") is None and pool.lookup(b"c") is None
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_refreed_block_goes_to_the_back_of_the_queue() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.free([a, b, c])
    pool.touch([a])
    pool.free([a])  # a is now the most recently freed
    assert _ids(pool.allocate(3)) == [b.block_id, c.block_id, a.block_id]
