"""Counters the scheduler keeps for metrics and the simulation table."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from scheduler.outputs import SchedulerOutput


@dataclass
class SpecDecodingStats:
    """Verification counts in the papers' terms (vLLM's metric names, our prefix).

    A "draft" is one request's verification in one step with s >= 1 drafts; its
    acceptance length is accepted + 1 (the bonus or recovered token).

    The names are vLLM's `spec_decode` metrics, kept on purpose so that dashboards
    built for vLLM read ours; so here `num_draft_tokens` counts drafts *verified*,
    while `SchedulerOutput.num_draft_tokens` is the k each request *proposes* this
    step (and `num_drafter_tokens` the rows of the widest drafter pass).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts verified / accepted at position i (0 = the first draft of a step).
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Verifications whose last accepted token was a drafted tree's leaf, not the chain's
    # draft (`draft_top_k` > 1); their accepted count includes it.
    num_leaf_hits: int = 0

    def record(self, verified: int, accepted: int) -> None:
        if verified:
            self.record_many([verified], [accepted])

    def record_many(self, verified: list[int], accepted: list[int]) -> None:
        """One step's verifications, each with verified >= 1 drafts."""
        if not verified:
            return
        v, a = np.asarray(verified), np.asarray(accepted)
        self.num_drafts += len(v)
        self.num_draft_tokens += int(v.sum())
        self.num_accepted_tokens += int(a.sum())
        width = max(int(v.max()), len(self.num_draft_tokens_per_pos))
        self.num_draft_tokens_per_pos = add_reaching(self.num_draft_tokens_per_pos, v, width)
        self.num_accepted_tokens_per_pos = add_reaching(self.num_accepted_tokens_per_pos, a,
                                                         width)

    @property
    def acceptance_rate(self) -> float | None:
        return (self.num_accepted_tokens / self.num_draft_tokens
                if self.num_draft_tokens else None)

    @property
    def mean_acceptance_length(self) -> float | None:
        return (1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None)

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [a / d for a, d in zip(self.num_accepted_tokens_per_pos,
                                      self.num_draft_tokens_per_pos, strict=True)]

    def as_dict(self) -> dict[str, object]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_per_pos": self.acceptance_per_pos,
            "num_draft_tokens_per_pos": list(self.num_draft_tokens_per_pos),
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "num_leaf_hits": self.num_leaf_hits,
        }


def reaching(counts: np.ndarray, width: int) -> np.ndarray:
    """[width]: how many of `counts` exceed i, for i < width.

    # counts [1, 3, 3], width 3: bincount [0, 1, 0, 2] -> from the top [3, 3, 2, 2]
    # -> positions 0, 1, 2 reached by [3, 2, 2]
    """
    return np.cumsum(np.bincount(counts, minlength=width + 1)[::-1])[::-1][1:width + 1]


def add_counts(per_pos: list[int], counts: list[int]) -> list[int]:
    """Element-wise sum of two count lists, the shorter one padded with zeros (lists,
    not arrays: called every step on a few entries, where numpy's padding costs more
    than the sum)."""
    return [a + b for a, b in zip_longest(per_pos, counts, fillvalue=0)]


def add_reaching(per_pos: list[int], counts: np.ndarray, width: int) -> list[int]:
    """per_pos[i] + how many of `counts` exceed i, for i < width."""
    return add_counts(per_pos, reaching(counts, width).tolist())


@dataclass
class GoodputStats:
    """What the goodput draft policy chose and how well it predicted step times."""

    # [k]: sampling requests that proposed k drafts (every sampling request counted).
    chosen_k: list[int] = field(default_factory=list)
    num_sampling_steps: int = 0  # steps with at least one sampling request
    num_steps_k0: int = 0  # ... of which none proposed a draft
    # Drafter rows run to catch up requests that were parked (k = 0: no drafter rows).
    catch_up_rows: int = 0
    num_timed_steps: int = 0
    predicted_seconds: float = 0.0  # summed over the timed steps
    measured_seconds: float = 0.0
    abs_error_seconds: float = 0.0
    last_predicted_seconds: float | None = None
    last_measured_seconds: float | None = None
    # Timed steps the time model took for stalls and fitted at a cap (StepTimeModel
    # `_clip_stalls`), as of its last fit.
    stall_steps: int = 0
    # Verifications a request's own record needs to count as much as its states'
    # rates, as finished requests' spread says (scheduler/request_spread.py); None
    # before any finished.
    request_weight: float | None = None
    # Parked requests' shadow drafts checked (`SchedulerOutput.shadow_req_ids`), and
    # how many the request then sampled.
    shadow_checks: int = 0
    shadow_hits: int = 0

    def record_shadows(self, accepted: list[int]) -> None:
        self.shadow_checks += len(accepted)
        self.shadow_hits += sum(accepted)

    def record_drafts(self, k: np.ndarray) -> None:
        """The k of every sampling request of one step."""
        if not len(k):
            return
        self.num_sampling_steps += 1
        if k.any():
            self.chosen_k = add_counts(self.chosen_k, np.bincount(k).tolist())
            return
        self.num_steps_k0 += 1  # most steps under load: no histogram to build
        self.chosen_k = add_counts(self.chosen_k, [len(k)])

    def record_time(self, predicted: float, measured: float) -> None:
        self.num_timed_steps += 1
        self.predicted_seconds += predicted
        self.measured_seconds += measured
        self.abs_error_seconds += abs(predicted - measured)
        self.last_predicted_seconds, self.last_measured_seconds = predicted, measured

    @property
    def share_steps_k0(self) -> float | None:
        return self.num_steps_k0 / self.num_sampling_steps if self.num_sampling_steps else None

    def as_dict(self) -> dict[str, object]:
        timed = self.num_timed_steps
        return {
            "chosen_k": list(self.chosen_k),
            "share_steps_k0": self.share_steps_k0,
            "catch_up_rows": self.catch_up_rows,
            "mean_predicted_step_seconds": self.predicted_seconds / timed if timed else None,
            "mean_measured_step_seconds": self.measured_seconds / timed if timed else None,
            "mean_abs_error_seconds": self.abs_error_seconds / timed if timed else None,
            "stall_steps": self.stall_steps,
            "request_weight": self.request_weight,
            "shadow_checks": self.shadow_checks,
            "shadow_hits": self.shadow_hits,
        }


@dataclass
class SchedulerStats:
    """Cumulative counts since start; the per-pass peaks show how tight B ran."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    num_scheduled_tokens: int = 0
    peak_pass_rows: dict[str, int] = field(default_factory=dict)
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    goodput: GoodputStats = field(default_factory=GoodputStats)

    def record_step(self, output: SchedulerOutput) -> None:
        self.num_steps += 1
        self.num_scheduled_tokens += output.total_num_scheduled_tokens
        for name, rows in output.pass_rows.items():
            self.peak_pass_rows[name] = max(self.peak_pass_rows.get(name, 0), rows)

    def record_verification(self, verified: int, accepted: int) -> None:
        self.spec.record(verified, accepted)

    @property
    def num_verified_drafts(self) -> int:
        return self.spec.num_draft_tokens

    @property
    def num_accepted_drafts(self) -> int:
        return self.spec.num_accepted_tokens
