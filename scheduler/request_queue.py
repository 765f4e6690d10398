"""Waiting queues: first-come-first-served, or by priority (lower value first)."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from scheduler.request import Request


class RequestQueue(ABC):
    """The waiting line; `peek` is the only request that may be admitted next."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def readd_preempted(self, request: Request) -> None:
        """Queue a preempted request so it resumes before newer arrivals."""

    @abstractmethod
    def peek(self) -> Request:
        """The head of the line (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the head."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Drop a request (an abort) wherever it stands."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The requests in admission order."""

    @abstractmethod
    def __len__(self) -> int:
        """How many are waiting."""


class FcfsQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def readd_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityQueue(RequestQueue):
    """Ordered by (priority, arrival time); a preempted request keeps its place."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def add(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._tiebreak), request)
        heapq.heappush(self._heap, entry)

    def readd_preempted(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))

    def __len__(self) -> int:
        return len(self._heap)


def make_queue(policy: str) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FcfsQueue()
