"""Which data-parallel replica takes a request: pure, so it is tested without Ray.

vLLM's data-parallel rule: the least loaded replica by `4 * waiting + running` (the
front end counts its own requests in flight there, so one sent a moment ago counts).
Ties go by prefix-cache affinity: a hash of the prompt's first KV block ranks the tied replicas
(rendezvous hashing), so prompts that share a first block keep landing on the same
replica, where its blocks are cached, while the set of tied replicas changes.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from dataclasses import dataclass


class ReplicaState(enum.StrEnum):
    STARTING = "starting"  # not ready yet (loading, or restarting after a death)
    READY = "ready"
    DEAD = "dead"  # its last call failed; Ray restarts it, and it comes back ready


@dataclass
class ReplicaLoad:
    """What the router knows of one replica."""

    index: int
    state: ReplicaState = ReplicaState.STARTING
    waiting: int = 0
    running: int = 0

    @property
    def score(self) -> int:
        return 4 * self.waiting + self.running


def first_block_key(prompt_token_ids: list[int], block_size: int) -> bytes:
    return array("q", prompt_token_ids[:block_size]).tobytes()


def _affinity(key: bytes, index: int) -> bytes:
    return hashlib.blake2b(key + index.to_bytes(4, "little"), digest_size=8).digest()


def pick_replica(replicas: list[ReplicaLoad], prompt_token_ids: list[int],
                 block_size: int, exclude: frozenset[int] = frozenset()) -> ReplicaLoad | None:
    """The ready replica to send this prompt to (None if none is ready)."""
    ready = [r for r in replicas if r.state is ReplicaState.READY and r.index not in exclude]
    if not ready:
        return None
    best = min(r.score for r in ready)
    tied = [r for r in ready if r.score == best]
    if len(tied) == 1:
        return tied[0]
    key = first_block_key(prompt_token_ids, block_size)
    return max(tied, key=lambda r: _affinity(key, r.index))
