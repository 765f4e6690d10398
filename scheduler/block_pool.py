"""A ref-counted pool of KV cache blocks with a prefix cache and LRU eviction.

A block is either in use (ref_cnt > 0) or free (ref_cnt == 0, in the free queue).
A free block may still hold a cached prefix (it keeps its hash) until it is handed
out again: eviction is lazy, oldest-freed first, so recently used prefixes survive.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    """One block of `block_size` KV slots."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # Cached while its request's drafter held it too (False: filled while the request
    # was parked, so its drafter slots are stale; its target features are cached).
    drafter_computed: bool = True


class BlockPool:
    """Hands out blocks, counts references, and keeps the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the front was freed longest ago.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks
        )
        self._cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use; cached-but-free blocks count as free."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[KVCacheBlock]:
        """Take `count` free blocks, evicting the prefixes they still cache."""
        if count > len(self._free):
            raise RuntimeError(f"allocate({count}) with only {len(self._free)} free blocks")
        taken = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Share cached blocks with one more request (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; pass the request's blocks tail first so the
        tail (least likely to be shared) is evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block's content hash; the first block with a hash keeps it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None

    def check_integrity(self) -> None:
        """Raise AssertionError if any bookkeeping disagrees with the blocks."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt {block.ref_cnt}"
            assert in_free == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt={block.ref_cnt} but in_free={in_free}"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash the cache map does not point back to"
                )
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"cache map entry for block {block.block_id}"
        assert all(self._free[i] is self.blocks[i] for i in self._free)
