"""Keeping the target's features while it generates (drafter training data).

A head learns from the inputs of three target layers and the target's own next-token
distribution at every position of the text it will draft. The runner computes both
for every row it runs anyway; with a capture attached it keeps them per request, so
training data costs one generation pass instead of a generation pass and a second,
teacher-forced one over the same tokens.

Speculation must be off (with drafts in the pass, rows past the accepted prefix hold
features of tokens the target rejected) and prefix caching too (a cache hit skips the
positions it covers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CapturedFeatures:
    """One request's features, by position from 0: every position the target ran (the
    prompt and each generated token but the last, which no pass has read yet)."""

    aux: torch.Tensor  # [L, len(aux_layer_ids) * hidden], the layers' inputs
    final: torch.Tensor  # [L, hidden], the final normed hidden state (logits = LM head of it)


class FeatureCapture:
    """Per request, the rows of each step, in `dtype` (float16 halves the memory of a
    training set).

    A step's rows are kept as one tensor (two: the layers' inputs and the final states)
    and each request holds where its rows lie in it. Kept as two small tensors per
    request and step, the default `train-drafter` (float32 target, 128 requests at
    once) grew 1.45 GB of resident memory in its data's minutes 1.5 to 6, against 0.38
    now (AVX2 EPYC), and was killed for memory on a 24 GiB machine at 17 minutes."""

    def __init__(self, aux_layer_ids: tuple[int, ...], dtype: torch.dtype = torch.float16
                 ) -> None:
        if not aux_layer_ids:
            raise ValueError("aux_layer_ids must name at least one target layer")
        self.aux_layer_ids = aux_layer_ids
        self.dtype = dtype
        # Each step's rows, by step number, and how many of them are still held: a
        # step is dropped from both once every request's share is taken or discarded.
        self._steps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._held: dict[int, int] = {}
        self._next_step = 0
        # Per request: (first position, step, its first row in the step, rows).
        self._pieces: dict[str, list[tuple[int, int, int, int]]] = {}

    def record(self, req_ids: list[str], starts: np.ndarray, counts: np.ndarray,
               aux: torch.Tensor, final: torch.Tensor) -> None:
        """One step's rows: request i ran `counts[i]` positions from `starts[i]`, its
        rows consecutive in `aux` and `final` in request order."""
        step, rows = self._next_step, int(counts.sum())
        self._next_step += 1
        self._steps[step] = (aux[:rows].to("cpu", self.dtype), final[:rows].to("cpu", self.dtype))
        self._held[step] = rows
        offset = 0
        for req_id, start, count in zip(req_ids, starts.tolist(), counts.tolist(),
                                        strict=True):
            self._pieces.setdefault(req_id, []).append((start, step, offset, count))
            offset += count

    def _release(self, step: int, rows: int) -> None:
        self._held[step] -= rows
        if self._held[step] == 0:
            del self._steps[step], self._held[step]

    def take(self, req_id: str) -> CapturedFeatures:
        """A request's features, forgotten here. Raises KeyError if none were kept; a
        gap or overlap between its steps (a preemption recomputed it) keeps the last
        computation of each position."""
        pieces = self._pieces.pop(req_id)
        length = max(start + count for start, _, _, count in pieces)
        first = self._steps[pieces[0][1]]  # held until this request's rows are taken
        aux = torch.empty((length, first[0].shape[1]), dtype=self.dtype)
        final = torch.empty((length, first[1].shape[1]), dtype=self.dtype)
        seen = torch.zeros(length, dtype=torch.bool)
        for start, step, offset, count in pieces:
            rows = self._steps[step]
            aux[start:start + count] = rows[0][offset:offset + count]
            final[start:start + count] = rows[1][offset:offset + count]
            seen[start:start + count] = True
            self._release(step, count)
        if not bool(seen.all()):
            raise ValueError(f"request {req_id!r}: positions "
                             f"{torch.nonzero(~seen).flatten()[:4].tolist()} were never run "
                             f"(a prefix-cache hit skips them)")
        return CapturedFeatures(aux, final)

    def discard(self, req_id: str) -> None:
        for _, step, _, count in self._pieces.pop(req_id, []):
            self._release(step, count)

    def held_steps(self) -> int:
        """Steps whose rows are still kept (some request has not been taken)."""
        return len(self._steps)
