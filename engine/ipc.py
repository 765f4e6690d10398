"""The messages between the API process and the engine-core process, and their codec.

One message each way per round, never one per request: the API process sends the
requests added, aborted and stopped since its last message; the engine process sends,
once per step, every request's new token ids (with logprobs where asked), the
requests it refused, and a snapshot of the counts the metrics read. A step's message
carries only what the step produced, so it does not grow with the prompts.

Messages are msgpack (msgspec), each struct encoded as an array (field names are not
sent). Both processes run this file's code, so the schema needs no versioning.
"""

from __future__ import annotations

from typing import Any

import msgspec

from scheduler import EngineCoreOutput, Request, SamplingParams
from scheduler.stats import SchedulerStats


class NewRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    priority: int = 0

    def to_request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.params,
                       eos_token_id=self.eos_token_id, priority=self.priority)


class EngineInputs(msgspec.Struct, array_like=True, tag="in"):
    """API -> engine. `stops`: requests the detokenizer found a stop string in (they
    finish as "stop", not as aborts)."""

    adds: list[NewRequest] = []
    aborts: list[str] = []
    stops: list[str] = []
    shutdown: bool = False


class Snapshot(msgspec.Struct, array_like=True):
    """What the metrics read of the engine after a step (engine/metrics.py CoreView)."""

    running: int
    waiting: int
    kv_usage: float
    pass_rows: dict[str, int]
    stats: SchedulerStats


class TokenUpdate(msgspec.Struct, array_like=True):
    """`EngineCoreOutput` as sent: the same fields, without their names."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[tuple[list[int], list[float]]]
    error: str | None

    @classmethod
    def of(cls, out: EngineCoreOutput) -> TokenUpdate:
        return cls(out.request_id, out.new_token_ids, out.finished, out.finish_reason,
                   out.logprobs, out.error)


class StepOutputs(msgspec.Struct, array_like=True, tag="step"):
    """Engine -> API, once per step (or once per round of refusals without a step)."""

    outputs: list[TokenUpdate]
    refused: list[tuple[str, str]]  # (request id, why), refused at admission
    snapshot: Snapshot


class Ready(msgspec.Struct, array_like=True, tag="ready"):
    """The engine process loaded its model and serves."""

    pid: int
    description: str
    node: str = ""  # the Ray node a replica runs on


class Failed(msgspec.Struct, array_like=True, tag="failed"):
    """The engine process's last word before it exits on a fault it cannot recover."""

    kind: str  # the exception's type name: "ValueError" at start means bad settings
    message: str

    @property
    def error(self) -> str:
        return f"{self.kind}: {self.message}"


FromEngine = StepOutputs | Ready | Failed


class Codec:
    """Encoder and typed decoders, built once per process (msgspec caches the
    schema in them)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._to_engine = msgspec.msgpack.Decoder(EngineInputs)
        self._from_engine: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(FromEngine)

    def encode(self, message: EngineInputs | StepOutputs | Ready | Failed) -> bytes:
        return self._encoder.encode(message)

    def decode_inputs(self, data: bytes) -> EngineInputs:
        return self._to_engine.decode(data)

    def decode_outputs(self, data: bytes) -> StepOutputs | Ready | Failed:
        decoded: StepOutputs | Ready | Failed = self._from_engine.decode(data)
        return decoded
