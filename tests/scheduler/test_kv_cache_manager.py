"""KVCacheManager: block counts, prefix hits, hash chaining, eviction and freeing."""

from __future__ import annotations

import pytest

from scheduler import CacheConfig, Request
from scheduler.kv_cache_manager import KVCacheManager, cdiv, hash_block

BS = 4


def _manager(num_blocks: int = 16, block_size: int = BS, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                      enable_prefix_caching=caching))


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens)


def _prefill(kv: KVCacheManager, request: Request) -> None:
    """Admit a request the way the scheduler does: prefix hit, slots, compute, cache."""
    prefix = kv.find_prefix(request)
    cached = len(prefix) * kv.block_size
    assert kv.allocate_slots(request, request.num_tokens - cached, 0, prefix)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks([request])


def _held(kv: KVCacheManager, request: Request) -> int:
    return len(kv.req_blocks.get(request.request_id, []))


@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 8, 9, 17])
def test_allocate_slots_takes_ceil_blocks(num_tokens: int) -> None:
    kv = _manager()
    request = _req("a", list(range(num_tokens)))
    assert kv.allocate_slots(request, num_tokens)
    expected = -(-num_tokens // BS)
    assert _held(kv, request) == expected
    assert kv.pool.num_free_blocks == 16 - expected
    assert kv.blocks_needed(num_tokens) == expected
    kv.pool.check_integrity()


@pytest.mark.parametrize(("num_tokens", "lookahead"), [(4, 1), (3, 1), (5, 3), (8, 4), (1, 0)])
def test_allocate_slots_counts_lookahead(num_tokens: int, lookahead: int) -> None:
    kv = _manager()
    request = _req("a", list(range(num_tokens)))
    assert kv.allocate_slots(request, num_tokens, lookahead)
    assert _held(kv, request) == -(-(num_tokens + lookahead) // BS)


def test_allocate_slots_grows_only_by_missing_blocks() -> None:
    kv = _manager()
    request = _req("a", list(range(6)))
    assert kv.allocate_slots(request, 6)  # 6 slots: 2 blocks
    request.num_computed_tokens = 6
    before = list(kv.block_ids("a"))
    assert kv.allocate_slots(request, 2)  # 8 slots: still 2 blocks
    assert kv.block_ids("a") == before
    assert kv.allocate_slots(request, 3, 2)  # 11 slots: 3 blocks
    assert kv.block_ids("a")[:2] == before
    assert _held(kv, request) == 3
    kv.pool.check_integrity()


def test_allocate_slots_short_pool_returns_false_and_changes_nothing() -> None:
    kv = _manager(num_blocks=4)
    other = _req("other", list(range(8)))
    assert kv.allocate_slots(other, 8)  # 2 of 4 blocks
    request = _req("a", list(range(9)))
    assert not kv.allocate_slots(request, 9)  # needs 3
    assert "a" not in kv.req_blocks or kv.req_blocks["a"] == []
    assert kv.pool.num_free_blocks == 2
    # Lookahead pushes an otherwise fitting request over the edge, too.
    request2 = _req("b", list(range(8)))
    assert not kv.allocate_slots(request2, 8, 1)
    assert kv.pool.num_free_blocks == 2
    assert kv.allocate_slots(request2, 8)
    assert kv.pool.num_free_blocks == 0
    kv.pool.check_integrity()


def test_allocate_slots_short_pool_with_prefix_does_not_touch_it() -> None:
    kv = _manager(num_blocks=4)
    first = _req("first", list(range(9)))
    _prefill(kv, first)  # 3 blocks, 2 cached full blocks
    kv.free(first, finished=True)
    filler = _req("filler", list(range(100, 104)))
    assert kv.allocate_slots(filler, 4)  # one block: the tail of `first`
    second = _req("second", list(range(9)) + list(range(50, 58)))
    prefix = kv.find_prefix(second)
    assert len(prefix) == 2
    refs = [block.ref_cnt for block in prefix]
    free = kv.pool.num_free_blocks
    # 17 tokens need 5 blocks: 2 from the prefix, 3 new, but only 1 free is not a hit.
    assert not kv.can_allocate(second, 17 - 8, 0, prefix)
    assert not kv.allocate_slots(second, 17 - 8, 0, prefix)
    assert [block.ref_cnt for block in prefix] == refs
    assert kv.pool.num_free_blocks == free
    assert kv.block_ids("second") == []
    kv.pool.check_integrity()


def test_prefix_blocks_in_free_queue_are_not_counted_twice() -> None:
    # The pool holds 3 blocks: a prefix hit on 2 free cached blocks leaves only 1 to
    # allocate, so a request needing 2 new blocks on top must be refused.
    kv = _manager(num_blocks=3)
    first = _req("first", list(range(9)))
    _prefill(kv, first)
    kv.free(first, finished=True)
    assert kv.pool.num_free_blocks == 3
    second = _req("second", list(range(8)) + [77] * 8)  # 16 tokens: 4 blocks total
    prefix = kv.find_prefix(second)
    assert len(prefix) == 2
    assert not kv.allocate_slots(second, 8, 0, prefix)
    assert kv.pool.num_free_blocks == 3
    assert all(block.ref_cnt == 0 for block in prefix)
    kv.pool.check_integrity()


def test_second_request_with_same_prompt_shares_full_blocks() -> None:
    kv = _manager()
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = _req("a", prompt)
    _prefill(kv, a)
    b = _req("b", prompt)
    prefix = kv.find_prefix(b)
    assert len(prefix) == 2
    assert [blk.block_id for blk in prefix] == kv.block_ids("a")[:2]
    assert kv.allocate_slots(b, 10 - 8, 0, prefix)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.block_ids("b")[2] != kv.block_ids("a")[2]
    assert all(block.ref_cnt == 2 for block in prefix)
    kv.pool.check_integrity()
    kv.free(a, finished=True)
    assert all(block.ref_cnt == 1 for block in prefix)
    kv.free(b, finished=True)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    kv.pool.check_integrity()


@pytest.mark.parametrize("num_tokens", [4, 7, 8, 9, 12, 13, 16])
def test_prefix_hit_is_capped_one_token_short(num_tokens: int) -> None:
    kv = _manager()
    prompt = list(range(num_tokens))
    _prefill(kv, _req("a", prompt))
    hits = kv.find_prefix(_req("b", prompt))
    # At least the last known token must be computed again to sample from it.
    assert len(hits) * BS <= num_tokens - 1
    # ...and every full block before that token is reused.
    assert len(hits) == (num_tokens - 1) // BS


def test_prompt_of_exactly_n_full_blocks_reuses_n_minus_one() -> None:
    kv = _manager()
    prompt = list(range(3 * BS))
    a = _req("a", prompt)
    _prefill(kv, a)
    assert len(kv.find_prefix(_req("b", prompt))) == 2
    # One more token and all three blocks hit.
    assert len(kv.find_prefix(_req("c", [*prompt, 999]))) == 3


def test_different_prompts_share_only_the_common_full_block_prefix() -> None:
    kv = _manager()
    base = list(range(16))
    _prefill(kv, _req("a", base))
    # Diverges inside the third block (token index 10).
    other = [*base[:10], 500, 501, 502, 503, 504, 505, 506]
    hits = kv.find_prefix(_req("b", other))
    assert [blk.block_id for blk in hits] == kv.block_ids("a")[:2]
    # Diverges at the very first token: nothing shared.
    assert kv.find_prefix(_req("c", [999, *base[1:]])) == []


def test_hashes_chain_so_same_block_after_different_prefix_misses() -> None:
    kv = _manager()
    shared_block = [7, 7, 7, 7]
    _prefill(kv, _req("a", [1, 2, 3, 4, *shared_block, 0]))
    # The second block has the same tokens but follows a different first block.
    assert kv.find_prefix(_req("b", [5, 6, 7, 8, *shared_block, 0])) == []
    # Sanity: the hash function chains the parent in.
    assert hash_block(b"", shared_block) != hash_block(hash_block(b"", [1, 2, 3, 4]),
                                                       shared_block)


def test_evicted_blocks_stop_hitting() -> None:
    kv = _manager(num_blocks=4)
    prompt = list(range(13))  # 4 blocks, 3 full
    a = _req("a", prompt)
    _prefill(kv, a)
    kv.free(a, finished=True)
    assert len(kv.find_prefix(_req("probe1", prompt))) == 3
    # Reuse the whole pool for unrelated data: every cached block is evicted.
    filler = _req("filler", list(range(100, 116)))
    assert kv.allocate_slots(filler, 16)
    assert kv.find_prefix(_req("probe2", prompt)) == []
    kv.pool.check_integrity()


def test_eviction_from_the_tail_keeps_the_head_of_the_chain() -> None:
    kv = _manager(num_blocks=5)
    prompt = list(range(13))
    a = _req("a", prompt)
    _prefill(kv, a)  # 4 blocks, the first 3 cached
    table = list(kv.req_blocks["a"])
    kv.free(a, finished=True)  # tail first: the tail is evicted before the head
    filler = _req("filler", list(range(100, 116)))
    assert kv.allocate_slots(filler, 16)  # the unused block, then a's last three
    hits = kv.find_prefix(_req("probe", prompt))
    assert hits == table[:1]
    kv.pool.check_integrity()


def test_evicting_the_first_block_breaks_the_whole_chain() -> None:
    kv = _manager(num_blocks=4)
    prompt = list(range(13))
    a = _req("a", prompt)
    _prefill(kv, a)
    table = list(kv.req_blocks["a"])
    kv.free(a, finished=True)
    kv.pool.touch(table[1:3])  # keep blocks 2 and 3 of the chain alive
    filler = _req("filler", list(range(100, 108)))
    assert kv.allocate_slots(filler, 8)  # takes the tail and the head block
    assert table[0].block_hash is None
    assert table[1].block_hash is not None and table[2].block_hash is not None
    kv.pool.free(table[1:3])
    # Later blocks are still cached, but without the head nothing matches.
    assert kv.find_prefix(_req("probe", prompt)) == []
    kv.pool.check_integrity()


def test_caching_disabled_never_hits() -> None:
    kv = _manager(caching=False)
    prompt = list(range(13))
    _prefill(kv, _req("a", prompt))
    assert kv.find_prefix(_req("b", prompt)) == []
    assert all(block.block_hash is None for block in kv.pool.blocks)


def test_cache_full_blocks_caches_only_computed_full_blocks() -> None:
    kv = _manager()
    request = _req("a", list(range(10)))
    assert kv.allocate_slots(request, 10)
    request.num_computed_tokens = 7  # one full block computed, the second not yet
    kv.cache_full_blocks([request])
    blocks = kv.req_blocks["a"]
    assert blocks[0].block_hash is not None
    assert blocks[1].block_hash is None
    request.num_computed_tokens = 10
    kv.cache_full_blocks([request])
    assert blocks[1].block_hash is not None
    assert blocks[2].block_hash is None  # partial block never cached
    kv.pool.check_integrity()


def test_free_after_finish_leaves_pool_fully_free() -> None:
    kv = _manager(num_blocks=12)
    prompt = list(range(11))
    requests = [_req(f"r{i}", prompt) for i in range(3)]
    for request in requests:
        _prefill(kv, request)
    assert kv.usage() > 0
    for request in requests:
        kv.free(request, finished=True)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert kv.usage() == 0.0
    assert kv.req_blocks == {}
    assert kv._hashes == {}
    kv.pool.check_integrity()


def test_free_is_idempotent_for_a_request_without_blocks() -> None:
    kv = _manager()
    request = _req("never", [1, 2, 3])
    kv.free(request, finished=True)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    kv.pool.check_integrity()


def test_cdiv() -> None:
    assert [cdiv(n, 4) for n in range(0, 10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
