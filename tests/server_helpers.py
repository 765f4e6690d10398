"""The default model's engine served by a real uvicorn on 127.0.0.1, for server tests."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.connection_limits import ConnectionLimits
from engine.local_server import ServerThread, serve_in_thread
from engine.process_engine import ProcessEngine
from engine.serving import ServingEngine
from runner.model_loader import load_model
from runner.model_prep import resolve_model
from runner.models.llama import LlamaForCausalLM
from spec_decode import SpeculativeConfig

__all__ = ["MODEL_NAME", "SPEC", "ServerThread", "default_model", "make_engine",
           "make_process_engine", "serve"]

MODEL_NAME = "smollm2-135m"
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@functools.cache
def default_model() -> LlamaForCausalLM:
    """The default model, loaded once per test process and shared by every engine
    (each runner owns its KV cache; the model holds no per-request state)."""
    return load_model(resolve_model(None), torch.float32, torch.device("cpu"))


def make_engine(**config: Any) -> AsyncEngine:
    """An AsyncEngine over the shared default model; n-gram speculation unless given."""
    config.setdefault("speculative_config", SpeculativeConfig.from_dict(SPEC))
    return AsyncEngine(EngineConfig(**config), model=default_model())


def make_process_engine(**config: Any) -> ProcessEngine:
    """A ProcessEngine (the engine core in its own process, which loads the default
    model itself) with make_engine's defaults, in float32 as the shared model is."""
    config.setdefault("speculative_config", SpeculativeConfig.from_dict(SPEC))
    config.setdefault("dtype", "float32")
    return ProcessEngine(EngineConfig(**config))


@contextmanager
def serve(engine: ServingEngine, name: str = MODEL_NAME,
          limits: ConnectionLimits | None = None) -> Iterator[ServerThread]:
    """`build_app(engine, name)` on a free port until the block ends; the engine stays up."""
    with serve_in_thread(engine, name, limits=limits) as thread:
        yield thread
