"""Counters the scheduler keeps for metrics and the simulation table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.outputs import SchedulerOutput


@dataclass
class SchedulerStats:
    """Cumulative counts since start; the per-pass peaks show how tight B ran."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_verified_drafts: int = 0
    num_accepted_drafts: int = 0
    peak_pass_rows: dict[str, int] = field(default_factory=dict)

    def record_step(self, output: SchedulerOutput) -> None:
        self.num_steps += 1
        self.num_scheduled_tokens += output.total_num_scheduled_tokens
        for name, rows in output.pass_rows.items():
            self.peak_pass_rows[name] = max(self.peak_pass_rows.get(name, 0), rows)

    def record_verification(self, verified: int, accepted: int) -> None:
        self.num_verified_drafts += verified
        self.num_accepted_drafts += accepted
