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
    training set)."""

    def __init__(self, aux_layer_ids: tuple[int, ...], dtype: torch.dtype = torch.float16
                 ) -> None:
        if not aux_layer_ids:
            raise ValueError("aux_layer_ids must name at least one target layer")
        self.aux_layer_ids = aux_layer_ids
        self.dtype = dtype
        self._chunks: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def record(self, req_ids: list[str], starts: np.ndarray, counts: np.ndarray,
               aux: torch.Tensor, final: torch.Tensor) -> None:
        """One step's rows: request i ran `counts[i]` positions from `starts[i]`, its
        rows consecutive in `aux` and `final` in request order."""
        offset = 0
        for req_id, start, count in zip(req_ids, starts.tolist(), counts.tolist(),
                                        strict=True):
            rows = slice(offset, offset + count)
            self._chunks.setdefault(req_id, []).append(
                (start, aux[rows].to("cpu", self.dtype), final[rows].to("cpu", self.dtype)))
            offset += count

    def take(self, req_id: str) -> CapturedFeatures:
        """A request's features, forgotten here. Raises KeyError if none were kept; a
        gap or overlap between its steps (a preemption recomputed it) keeps the last
        computation of each position."""
        chunks = self._chunks.pop(req_id)
        length = max(start + len(a) for start, a, _ in chunks)
        aux = torch.empty((length, chunks[0][1].shape[1]), dtype=self.dtype)
        final = torch.empty((length, chunks[0][2].shape[1]), dtype=self.dtype)
        seen = torch.zeros(length, dtype=torch.bool)
        for start, a, f in chunks:
            aux[start:start + len(a)] = a
            final[start:start + len(f)] = f
            seen[start:start + len(a)] = True
        if not bool(seen.all()):
            raise ValueError(f"request {req_id!r}: positions "
                             f"{torch.nonzero(~seen).flatten()[:4].tolist()} were never run "
                             f"(a prefix-cache hit skips them)")
        return CapturedFeatures(aux, final)

    def discard(self, req_id: str) -> None:
        self._chunks.pop(req_id, None)
