"""Shared test setup: hypothesis profiles and small builders."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


HAS_CUDA = _has_cuda()
# Triton kernels run on CPU only under the interpreter, which must be switched on
# before the first @triton.jit runs; with a GPU they compile for real.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

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
