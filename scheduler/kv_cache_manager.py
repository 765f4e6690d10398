"""Per-request block tables on top of the block pool: prefix hits, slots, freeing."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np

from scheduler.block_pool import BlockPool, KVCacheBlock
from scheduler.config import CacheConfig
from scheduler.request import Request


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Chain hash of one full block: equal hashes mean equal whole prefixes.

    A cryptographic digest, not Python's `hash`, so that a client cannot craft a
    prompt whose block collides with another tenant's cached prefix.
    """
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


IntLike = TypeVar("IntLike", int, np.ndarray)


def cdiv(a: IntLike, b: int) -> IntLike:
    """Ceiling division, for ints and numpy arrays alike: the project's only one."""
    return -(-a // b)


class KVCacheManager:
    """Owns each request's block list; the scheduler asks it for slots by token count."""

    def __init__(self, cache_config: CacheConfig) -> None:
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.pool = BlockPool(cache_config.num_blocks, cache_config.enable_prefix_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # Hash chain over each request's full blocks of known tokens.
        self._hashes: dict[str, list[bytes]] = {}
        # How many of a request's leading blocks are registered in the prefix cache.
        self._num_cached: dict[str, int] = {}

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from index `start` on (new ones only, per step)."""
        return [block.block_id for block in self.req_blocks.get(request_id, ())[start:]]

    def _block_hashes(self, request: Request) -> list[bytes]:
        hashes = self._hashes.setdefault(request.request_id, [])
        size = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * size <= len(tokens):
            start = len(hashes) * size
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, tokens[start:start + size]))
        return hashes

    def find_prefix(self, request: Request) -> list[KVCacheBlock]:
        """Longest run of cached blocks matching the request's leading tokens.

        Capped one token short of all known tokens: the step must compute at least
        the last token to sample the next one.
        """
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self._block_hashes(request)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, request: Request, num_new_tokens: int, num_lookahead: int,
                     prefix: list[KVCacheBlock] | None = None) -> bool:
        return self._num_new_blocks(request, num_new_tokens, num_lookahead, prefix) is not None

    def _num_new_blocks(self, request: Request, num_new_tokens: int, num_lookahead: int,
                        prefix: list[KVCacheBlock] | None) -> int | None:
        prefix = prefix or []
        held = len(self.req_blocks.get(request.request_id, ()))
        computed = request.num_computed_tokens + len(prefix) * self.block_size
        needed = self.blocks_needed(computed + num_new_tokens + num_lookahead)
        new = max(needed - held - len(prefix), 0)
        # Prefix blocks sitting in the free queue stop being free once shared.
        reclaimed = sum(1 for block in prefix if block.ref_cnt == 0)
        return new if new <= self.pool.num_free_blocks - reclaimed else None

    def allocate_slots(self, request: Request, num_new_tokens: int, num_lookahead: int = 0,
                       prefix: list[KVCacheBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` past the computed ones (after any prefix
        hit) plus `num_lookahead` draft slots; False, changing nothing, if it can't."""
        new = self._num_new_blocks(request, num_new_tokens, num_lookahead, prefix)
        if new is None:
            return False
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if prefix:
            self.pool.touch(prefix)
            blocks.extend(prefix)
            self._num_cached[request.request_id] = len(blocks)
        blocks.extend(self.pool.allocate(new))
        return True

    def append_blocks(self, requests: Sequence[Request], counts: np.ndarray) -> None:
        """Give `counts[i]` more blocks to running request i (the caller checked that
        the pool holds them all)."""
        for i in np.flatnonzero(counts).tolist():  # most decoding steps fill no block
            self.req_blocks[requests[i].request_id].extend(self.pool.allocate(int(counts[i])))

    def cache_full_blocks(self, requests: Iterable[Request]) -> None:
        """Register every full block of verified, computed tokens in the prefix cache.

        Called with every request a step advanced; most filled no new block, so the
        check is kept to a division and a lookup per request."""
        if not self.enable_caching:
            return
        size, done = self.block_size, self._num_cached
        for request in requests:
            computed, known = request.num_computed_tokens, len(request.all_token_ids)
            # Not min(): a builtin call costs several times this comparison.
            num_full = (computed if computed < known else known) // size
            if num_full > done.get(request.request_id, 0):
                self._cache_blocks(request, num_full)

    def _cache_blocks(self, request: Request, num_full: int) -> None:
        rid = request.request_id
        hashes = self._block_hashes(request)
        blocks = self.req_blocks[rid]
        drafter_full = request.num_drafter_computed // self.block_size
        for i in range(self._num_cached.get(rid, 0), num_full):
            self.pool.cache(blocks[i], hashes[i])
            blocks[i].drafter_computed = i < drafter_full
        self._num_cached[rid] = num_full

    def free(self, request: Request, finished: bool) -> None:
        """Release the request's blocks (tail first); forget its hashes if finished."""
        rid = request.request_id
        self.pool.free(reversed(self.req_blocks.pop(rid, [])))
        self._num_cached.pop(rid, None)
        if finished:
            self._hashes.pop(rid, None)
