"""Shared test setup: hypothesis profiles, the gpu skip, and the `model` marker's
enforcement (the fast loop, `pytest -m "not model"`, must never load the real model)."""

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


# Every real-model load in this process goes through load_model: counted here, so a
# test that loads the model without the `model` marker fails and says so. Wrapped
# before any test module (or the runner) imports the name.
from runner import model_loader  # noqa: E402

_LOADS = [0]
_load_model = model_loader.load_model


def _counted_load_model(*args, **kwargs):  # type: ignore[no-untyped-def]
    _LOADS[0] += 1
    return _load_model(*args, **kwargs)


model_loader.load_model = _counted_load_model  # type: ignore[assignment]
_BEFORE = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):  # type: ignore[no-untyped-def]
    item.stash[_BEFORE] = _LOADS[0]  # before any fixture, module-scoped ones included
    yield


@pytest.fixture(autouse=True)
def _model_marker_is_honest(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    yield
    loaded = _LOADS[0] - request.node.stash.get(_BEFORE, _LOADS[0])
    if loaded and "model" not in request.keywords:
        pytest.fail(f"{request.node.nodeid} loaded the real model {loaded}x without "
                    "@pytest.mark.model (`pytest -m 'not model'` must not load it)")


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
# The fast loop (`make test-fast`): the same properties on fewer examples.
settings.register_profile(
    "fast", derandomize=True, max_examples=15, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.register_profile(
    "dev", max_examples=400, stateful_step_count=120, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
