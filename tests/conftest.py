"""Shared test setup: hypothesis profiles and small builders."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# CI: derandomized and bounded, so its time is stable; dev: many more examples.
settings.register_profile(
    "ci", derandomize=True, max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.register_profile(
    "dev", max_examples=400, stateful_step_count=120, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
