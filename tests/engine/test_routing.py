"""The data-parallel router's rule (engine/routing.py), without Ray."""

from __future__ import annotations

from collections import Counter

from engine.routing import ReplicaLoad, ReplicaState, pick_replica

READY = ReplicaState.READY


def _loads(*scores: tuple[int, int], state: ReplicaState = READY) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, state, waiting, running) for i, (waiting, running)
            in enumerate(scores)]


def test_least_loaded_by_four_waiting_plus_running() -> None:
    # Scores 4*1 + 0 = 4, 4*0 + 5 = 5, 4*0 + 3 = 3.
    loads = _loads((1, 0), (0, 5), (0, 3))
    assert pick_replica(loads, [1, 2, 3], 16).index == 2  # type: ignore[union-attr]
    loads[2].waiting = 1  # one more waiting there: 4 * 1 + 3 = 7
    assert pick_replica(loads, [1, 2, 3], 16).index == 0  # type: ignore[union-attr]


def test_only_ready_replicas_and_not_excluded() -> None:
    loads = _loads((0, 0), (5, 5))
    loads[0].state = ReplicaState.DEAD
    assert pick_replica(loads, [1], 16).index == 1  # type: ignore[union-attr]
    assert pick_replica(loads, [1], 16, exclude=frozenset({1})) is None
    loads[1].state = ReplicaState.STARTING
    assert pick_replica(loads, [1], 16) is None


def test_ties_follow_the_first_block() -> None:
    """Equal load: a prompt's first block decides, so prompts sharing it (and their
    cached KV) land together, whatever follows, and different ones spread out."""
    loads = _loads((0, 2), (0, 2), (0, 2), (0, 2))
    block = list(range(100, 116))
    chosen = {pick_replica(loads, block + tail, 16).index  # type: ignore[union-attr]
              for tail in ([1], [2, 3], [9] * 40)}
    assert len(chosen) == 1
    spread = Counter(pick_replica(loads, [i] * 16, 16).index  # type: ignore[union-attr]
                     for i in range(400))
    assert set(spread) == {0, 1, 2, 3} and min(spread.values()) > 50


def test_affinity_survives_a_replica_leaving_the_tie() -> None:
    """Rendezvous hashing: a prompt that preferred replica r keeps r when another
    replica drops out of the tie."""
    loads = _loads((0, 1), (0, 1), (0, 1))
    moved = 0
    for i in range(200):
        prompt = [i, i + 1, i + 2]
        first = pick_replica(loads, prompt, 16).index  # type: ignore[union-attr]
        other = (first + 1) % 3
        loads[other].running = 9
        moved += pick_replica(loads, prompt, 16).index != first  # type: ignore[union-attr]
        loads[other].running = 1
    assert moved == 0


def test_load_alone_decides_when_not_tied() -> None:
    loads = _loads((0, 1), (0, 0))
    assert all(pick_replica(loads, [i] * 16, 16).index == 1  # type: ignore[union-attr]
               for i in range(50))
