"""One data-parallel replica: a whole engine core (scheduler, KV cache, model) in a Ray actor.

`engine/data_parallel.py` runs this class as a Ray actor named `EngineReplica`
(`ray.remote` wraps it there, so this file needs no Ray to import). Inside, the same
loop as the engine process of `specbudget serve` (engine/core_process.py `run_core`)
runs on a thread, and the actor only carries its messages (engine/ipc.py):

- `push(epoch, seq, data)`: one encoded `EngineInputs` from the front end. Ray does
  not promise that an async actor runs calls in the order they were made, so each
  carries a sequence number and is applied in order; `epoch` counts the front end's
  connections to this replica, and a call left over from an earlier one is dropped.
- `outputs()`: a Ray streaming generator of the loop's messages (`Ready`, then one
  `StepOutputs` per step, `Failed` before it stops on a fault), each item every
  message waiting when the front end asked, so a busy replica is not held back by
  one round trip per step. It ends when the loop does.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.core_process import run_core


class QueueChannel:
    """A `Channel` (engine/core_process.py) between threads of one process."""

    def __init__(self) -> None:
        self._items: deque[bytes] = deque()
        self._ready = threading.Condition()
        self._closed = False

    def poll(self, timeout: float | None = 0.0) -> bool:
        with self._ready:
            self._ready.wait_for(lambda: self._items or self._closed, timeout)
            return bool(self._items) or self._closed

    def recv_bytes(self) -> bytes:
        with self._ready:
            if not self._items:
                raise EOFError("channel closed")
            return self._items.popleft()

    def send_bytes(self, buf: bytes) -> None:
        with self._ready:
            self._items.append(buf)
            self._ready.notify()

    def take_all(self) -> list[bytes]:
        """Every message waiting, after waiting for one; [] once closed and drained."""
        with self._ready:
            self._ready.wait_for(lambda: self._items or self._closed)
            items = list(self._items)
            self._items.clear()
            return items

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()


class EngineReplica:
    """An engine core behind the calls the data-parallel front end makes."""

    def __init__(self, config: EngineConfig, index: int, num_threads: int) -> None:
        import torch  # here: the front end imports this file, and never needs torch

        # Replicas on one machine split its cores rather than each taking all of them.
        torch.set_num_threads(num_threads)
        self.index = index
        self._inputs = QueueChannel()
        self._outputs = QueueChannel()
        self._epoch = 0
        self._next_seq = 0
        self._held: dict[int, bytes] = {}
        node = ""
        try:
            import ray

            node = ray.get_runtime_context().get_node_id()
        except Exception:  # not in a Ray worker (the tests drive it directly too)
            node = ""
        self._thread = threading.Thread(target=self._run, args=(config, node), daemon=True,
                                        name=f"specbudget-replica-{index}")
        self._thread.start()

    def _run(self, config: EngineConfig, node: str) -> None:
        try:
            run_core(config, self._inputs, self._outputs, node)
        finally:
            self._outputs.close()

    def push(self, epoch: int, seq: int, data: bytes) -> None:
        if epoch < self._epoch:
            return  # meant for a connection that has ended
        if epoch > self._epoch:
            self._epoch, self._next_seq, self._held = epoch, 0, {}
        self._held[seq] = data
        while self._next_seq in self._held:
            self._inputs.send_bytes(self._held.pop(self._next_seq))
            self._next_seq += 1

    async def outputs(self) -> AsyncIterator[list[bytes]]:
        loop = asyncio.get_running_loop()
        while batch := await loop.run_in_executor(None, self._outputs.take_all):
            yield batch
