"""What a request or the engine can fail with, as the server tells them apart (light:
the API process imports it without the engine core)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop stopped after a fault; no request can be served."""


class RequestFailedError(RuntimeError):
    """A step failed and the engine traced the fault to this request (engine/core.py);
    the engine itself goes on serving."""


class EngineProcessDiedError(EngineDeadError):
    """The engine-core process died (killed, out of memory, a fault it could not
    recover from) while serving; the server answers 503 and may be restarting it."""


class EngineShutdownError(RuntimeError):
    """The server is shutting down and stopped waiting for this request."""


class ReplicaFailedError(RuntimeError):
    """The data-parallel replica serving this request died after it streamed tokens
    (engine/data_parallel.py); the other replicas go on serving."""
