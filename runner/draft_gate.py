"""When a chain drafter stops drafting: the confidence gate of sequential methods.

A chain drafter (eagle, mtp, a draft LM) pays one drafter pass per draft, and draft j
is worth something only if drafts 1 .. j - 1 are all accepted. The drafter's own
probability of each greedy draft estimates that: a request stops its chain once the
product of its drafts' probabilities falls below `min_draft_confidence`, and the
drafts it made are verified as they are (fewer than k: the scheduler learns it from
the drafts it gets back, as from a lookup that matched less). Lossless by
construction: only which drafts are proposed changes, never how they are verified.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from spec_decode import SpeculativeConfig

# Measured (`python benchmarks/draft_confidence.py --thresholds 0,0.1,0.2,0.25,0.3,0.4`,
# eagle's trained head, 24 held-out prompts, K = 4, side by side with speculation off
# on the 2-core Intel AMX machine; benchmarks/results/draft_confidence.json): at fixed
# K = 4, 1.268x off with every chain drawn to K and 1.314 / 1.334 / 1.333 / 1.332 /
# 1.328x at 0.1 / 0.2 / 0.25 / 0.3 / 0.4 (an earlier run: 1.340, then 1.353 / 1.375 /
# 1.409 / 1.417 / 1.381x); mean acceptance length 1.80 -> 1.79 ... 1.70: the passes it
# skips mostly sat behind a draft about to be rejected. 0.2-0.3 lead in both runs. A
# random head's drafts are never confident (about 1 / 8192), so it keeps drawing to K
# by default: layouts and benchmarks rely on its full chains.
TRAINED_HEAD_MIN_CONFIDENCE = 0.25
# A tree's depth d is won when any of its width(d) candidates is, more often than the
# chain's own draft there, so the chain's product of probabilities undersells the next
# pass and a tree's gate sits lower. Measured (eagle's trained head, [4, 2, 1], depth 4,
# 24 held-out prompts, by request beside off in one process, three rounds; the 2-core
# Intel AMX machine): 1.512 / 1.531 / 1.520 / 1.504x off at 0.15 / 0.2 / 0.25 / 0.3,
# mean acceptance length 2.022 / 2.017 / 1.990 at 0.15 / 0.2 / 0.25 (0.1: 2.029, one
# round 1.485x): 0.2 is the fastest and keeps the mean length over 2.
TRAINED_HEAD_TREE_MIN_CONFIDENCE = 0.2


class ConfidentNet(Protocol):
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def drafts_with_confidence(self, hidden: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def top_drafts(self, hidden: torch.Tensor, top_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]: ...


def min_draft_confidence(options: dict[str, Any], sequential: bool, trained: bool,
                         tree: bool = False) -> float:
    """The threshold a drafter serves with: `speculative_config`'s
    `min_draft_confidence` where given (SpeculativeConfig checked its range), else, for
    a trained head of a chain method, `TRAINED_HEAD_TREE_MIN_CONFIDENCE` when it drafts
    trees and `TRAINED_HEAD_MIN_CONFIDENCE` when chains, else 0 (every chain drawn to
    its k)."""
    if not sequential:
        return 0.0
    value = options.get("min_draft_confidence")
    if value is not None:
        return float(value)
    if not trained:
        return 0.0
    return TRAINED_HEAD_TREE_MIN_CONFIDENCE if tree else TRAINED_HEAD_MIN_CONFIDENCE


def gate_priced(spec: SpeculativeConfig, trained: bool, tree: bool) -> bool:
    """Whether a drafter's gate follows the scheduler's price of a draft
    (runner/draft_calibration.py) on the steps that price one: a trained head's chains
    under the goodput policy, where `min_draft_confidence` is not given. The best
    fixed threshold moved with the machine (0.2-0.3 on the 2-core Intel AMX machine,
    0.7-0.85 on the AVX2 EPYC, README), with what a drafter pass and a verified row
    cost of a step; the goodput policy's step-time model prices exactly that."""
    return (trained and not tree and spec.spec_method.sequential
            and spec.draft_policy == "goodput"
            and spec.options.get("min_draft_confidence") is None)


class ConfidenceGate:
    """One step's chains: each request's product of its drafts' probabilities so far,
    and which requests still draft: those whose product is at least `threshold`, or
    where `priced` is given, those it lets go on (runner/draft_calibration.py). With
    neither above 0 nor `record`, it computes no probability (a log-sum-exp over the
    draft vocabulary a draft: ~70 us on the CPU); `record` keeps each chain's
    products (`products`)."""

    def __init__(self, threshold: float, record: bool = False,
                 priced: Callable[[np.ndarray, int], np.ndarray] | None = None) -> None:
        self.threshold = threshold
        self.priced = priced
        self.record = record or priced is not None
        self._sure: dict[int, float] = {}
        self.products: dict[int, list[float]] = {}  # request -> c_1, c_2, ... (`record`)

    def drafts(self, net: ConfidentNet, hidden: torch.Tensor, reqs: list[int],
               widths: list[int] | None = None) -> list[list[int]]:
        """The candidates read out of `hidden` (row i a depth of request `reqs[i]`): the
        greedy draft, then `widths[i]` - 1 more (a tree's leaves; None: none); each
        request's product of its greedy drafts' probabilities updated."""
        weighs = self.threshold > 0.0 or self.record
        if widths is not None and max(widths, default=1) > 1:
            ids, probs = net.top_drafts(hidden, max(widths))
            candidates = [row[:width] for row, width in zip(ids.tolist(), widths, strict=True)]
        elif not weighs:
            return [[t] for t in net.greedy_tokens(hidden).tolist()]
        else:
            greedy, probs = net.drafts_with_confidence(hidden)
            candidates = [[t] for t in greedy.tolist()]
        if weighs:
            for req, prob in zip(reqs, probs.tolist(), strict=True):
                sure = self._sure[req] = self._sure.get(req, 1.0) * prob
                if self.record:
                    self.products.setdefault(req, []).append(sure)
        return candidates

    def still_drafting(self, reqs: np.ndarray, depth: int = 1) -> np.ndarray:
        """Those of `reqs`, each with `depth` drafts so far, whose chain goes on."""
        if not len(reqs) or (self.priced is None and self.threshold <= 0.0):
            return reqs
        sure = np.fromiter((self._sure.get(int(r), 1.0) for r in reqs), dtype=float,
                           count=len(reqs))
        if self.priced is not None:
            return reqs[self.priced(sure, depth)]
        return reqs[sure >= self.threshold]
