"""OpenAI-compatible request and response models, and every check made before a
request reaches the engine.

Validation policy (each refusal is an `APIError`: HTTP 400, an OpenAI error object
whose `param` names the field and whose message names the limit):

- The body must be strict JSON: `NaN` / `Infinity` literals and numbers that overflow
  to infinity are refused, as are bools where numbers are expected and numbers given
  as strings. Integers must be JSON integers (`max_tokens: 8.0` is refused).
- Unknown fields are ignored, as vLLM does (clients send vendor fields); OpenAI fields
  this server does not implement are refused when they would change the result
  (`echo`, `suffix`, `best_of` > n, `logit_bias`, penalties, tools, JSON mode).
- `model` may be omitted (the served model); any other name answers 404
  `model_not_found`, as OpenAI and vLLM do.
- A prompt of >= `max_model_len` tokens is refused, and so is a `max_tokens` larger
  than the room the prompt leaves (`max_model_len - prompt tokens`), naming the
  context length, the prompt tokens and the requested tokens, as vLLM and OpenAI do.
  Omitted, `max_tokens` is 16 for completions (OpenAI's default, clamped to the room)
  and the whole room for chat.
- Ranges: temperature [0, 2], top_p (0, 1], top_k -1 or 0 (off) or >= 1, min_p [0, 1],
  n [1, MAX_N], logprobs / top_logprobs [0, MAX_LOGPROBS], at most MAX_STOP stop
  strings (non-empty), seed a 64-bit signed integer, token ids in [0, vocab_size).
- A request the KV cache can never hold is refused by the engine with a ValueError;
  the server maps that to 400 too (`param` null, code `kv_cache_too_small`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    WithJsonSchema,
)

from engine.json_body import InvalidJSON, load_strict_json
from scheduler.request import INT64_MAX, INT64_MIN, MAX_LOGPROBS

MAX_N = 16
MAX_STOP = 16
MAX_TEMPERATURE = 2.0
INT64 = (INT64_MIN, INT64_MAX)
DEFAULT_COMPLETION_MAX_TOKENS = 16


class APIError(Exception):
    """A request the server refuses; `body()` is OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = "invalid_value",
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = (
            message, param, status, code, type)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def _finite_number(value: Any) -> float:
    # pydantic's lax float takes bools and numeric strings; OpenAI's schema does not.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return float(value)


Number = Annotated[float, BeforeValidator(_finite_number)]
# Every integer field is a JSON integer within int64: a larger one is refused with the
# limit named, never carried into the engine's int64 arrays (where it would overflow).
Int64 = Annotated[StrictInt, Field(ge=INT64[0], le=INT64[1])]


def _documented(**bounds: float) -> Any:
    """The range `check_sampling` enforces (with its own messages), stated in the
    published JSON schema too, so clients and schema-driven fuzzers see it."""
    return Field(json_schema_extra=dict(bounds))


# ---- requests ---------------------------------------------------------------------


_TOKEN_IDS = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
_PROMPT_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string"}, _TOKEN_IDS,
    {"type": "array", "items": {"anyOf": [{"type": "string"}, _TOKEN_IDS]},
     "minItems": 1, "maxItems": 1}]}
_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"const": "text"}, "text": {"type": "string"}}}
_MESSAGES_SCHEMA: dict[str, Any] = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}}}


def request_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema with its `$defs` inlined: self-contained, so it can
    stand in an OpenAPI document's requestBody as is."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return dict(inline(schema))


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share; unknown fields are ignored (pydantic's default)."""

    model: StrictStr | None = None
    max_tokens: Annotated[Int64 | None, _documented(minimum=1)] = None
    temperature: Annotated[Number | None, _documented(minimum=0, maximum=MAX_TEMPERATURE)] = None
    top_p: Annotated[Number | None, _documented(exclusiveMinimum=0, maximum=1)] = None
    top_k: Annotated[Int64 | None, _documented(minimum=-1)] = None  # extension: -1, 0 = off
    min_p: Annotated[Number | None, _documented(minimum=0, maximum=1)] = None  # extension
    n: Annotated[Int64, _documented(minimum=1, maximum=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Int64] | None = None  # extension
    seed: Int64 | None = None
    ignore_eos: StrictBool = False  # extension
    priority: Int64 = 0  # extension: lower is served first under policy="priority"
    logit_bias: dict[str, Any] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None  # vLLM's extension; only 1 (off) is served
    min_tokens: Annotated[Int64 | None, _documented(minimum=0)] = None  # extension
    user: StrictStr | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    # Checked by `prompt_input`; the schema says what is accepted (and what fuzzers send).
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)] = None
    logprobs: Annotated[Int64 | None, _documented(minimum=0, maximum=MAX_LOGPROBS)] = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: Int64 | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[Any, WithJsonSchema(_MESSAGES_SCHEMA)] = None  # `chat_messages`
    max_completion_tokens: Annotated[Int64 | None, _documented(minimum=1)] = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[Int64 | None, _documented(minimum=0, maximum=MAX_LOGPROBS)] = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


def parse_body(raw: bytes, model: type[CompletionRequest] | type[ChatCompletionRequest]
               ) -> Any:
    """Strict JSON (engine/json_body.py), then the pydantic model."""
    try:
        data = load_strict_json(raw)
    except InvalidJSON as err:
        raise APIError(str(err), param=err.param, code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _validation_error(err) from None


def _validation_error(err: ValidationError) -> APIError:
    """The first field pydantic refused; a union's members' complaints are joined."""
    errors = err.errors()
    field = errors[0]["loc"][0]
    same = [e for e in errors if e["loc"][0] == field]
    param = _param_path(same[0]["loc"]) if len(same) == 1 else str(field)
    reasons = "; or ".join(
        f"{_param_path(e['loc'])}: {e['msg'].removeprefix('Value error, ')}" for e in same)
    return APIError(f"{reasons} (got {same[0].get('input')!r:.100})", param=param)


def _param_path(loc: tuple[int | str, ...]) -> str:
    """('stop', 'list[str]', 0) -> 'stop.0': pydantic names union members in `loc`."""
    parts = [str(loc[0])] + [str(p) for p in loc[1:] if isinstance(p, int) or (
        p.isidentifier() and p not in {"str", "int", "float", "bool"})]
    return ".".join(parts)


# ---- checks that need the served model --------------------------------------------


@dataclass(frozen=True)
class ServingLimits:
    """What validation needs to know about the engine."""

    served_model_name: str
    max_model_len: int
    vocab_size: int


def check_model(req: _SamplingFields, limits: ServingLimits) -> None:
    if req.model is not None and req.model != limits.served_model_name:
        raise APIError(f"The model `{req.model}` does not exist; this server serves "
                       f"`{limits.served_model_name}`", param="model", status=404,
                       code="model_not_found")


def _range(ok: bool, param: str, limit: str, value: Any) -> None:
    if not ok:
        raise APIError(f"{param} must be {limit}, got {value!r}", param=param)


def check_sampling(req: _SamplingFields, limits: ServingLimits,
                   max_tokens_param: str = "max_tokens") -> None:
    """Ranges of the shared fields (see the module docstring)."""
    max_tokens = getattr(req, max_tokens_param)
    if max_tokens is not None:
        _range(max_tokens >= 1, max_tokens_param, ">= 1", max_tokens)
    if req.temperature is not None:
        _range(0 <= req.temperature <= MAX_TEMPERATURE, "temperature",
               f"in [0, {MAX_TEMPERATURE:g}]", req.temperature)
    if req.top_p is not None:
        _range(0 < req.top_p <= 1, "top_p", "in (0, 1]", req.top_p)
    if req.top_k is not None:
        _range(req.top_k >= -1, "top_k", ">= 1, or -1 / 0 to disable", req.top_k)
    if req.min_p is not None:
        _range(0 <= req.min_p <= 1, "min_p", "in [0, 1]", req.min_p)
    _range(1 <= req.n <= MAX_N, "n", f"in [1, {MAX_N}]", req.n)
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed when stream is true",
                       param="stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    _range(len(stops) <= MAX_STOP, "stop", f"at most {MAX_STOP} strings", len(stops))
    for stop in stops:
        _range(bool(stop), "stop", "non-empty strings", stop)
    for i, tok in enumerate(req.stop_token_ids or []):
        _range(0 <= tok < limits.vocab_size, f"stop_token_ids.{i}",
               f"a token id in [0, {limits.vocab_size})", tok)
    _unsupported(req.logit_bias, "logit_bias", "logit_bias is not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        _unsupported(value not in (None, 0.0), name, f"{name} other than 0 is not supported")
    _unsupported(req.repetition_penalty not in (None, 1.0), "repetition_penalty",
                 "repetition_penalty other than 1 is not supported")
    if req.min_tokens is not None:
        _range(req.min_tokens >= 0, "min_tokens", ">= 0", req.min_tokens)


def _unsupported(flag: Any, param: str, message: str) -> None:
    if flag:
        raise APIError(message, param=param, code="unsupported_parameter")


def check_completion_extras(req: CompletionRequest) -> None:
    if req.logprobs is not None:
        _range(0 <= req.logprobs <= MAX_LOGPROBS, "logprobs", f"in [0, {MAX_LOGPROBS}]",
               req.logprobs)
    _unsupported(req.echo, "echo", "echo is not supported")
    _unsupported(req.suffix, "suffix", "suffix is not supported")
    _unsupported(req.best_of not in (None, req.n), "best_of",
                 "best_of other than n is not supported")


def check_chat_extras(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None:
        _range(0 <= req.top_logprobs <= MAX_LOGPROBS, "top_logprobs",
               f"in [0, {MAX_LOGPROBS}]", req.top_logprobs)
        if not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        _range(req.max_tokens == req.max_completion_tokens, "max_completion_tokens",
               f"equal to max_tokens={req.max_tokens} when both are given",
               req.max_completion_tokens)
    for name in ("tools", "tool_choice", "functions", "function_call"):
        _unsupported(getattr(req, name), name, f"{name} is not supported")
    fmt = req.response_format
    _unsupported(fmt is not None and fmt.get("type") != "text", "response_format",
                 "response_format other than {'type': 'text'} is not supported")


def prompt_input(prompt: Any, limits: ServingLimits) -> str | list[int]:
    """The one prompt of a completion request: its text, or its token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _range(bool(prompt), "prompt", "a non-empty string", prompt)
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise APIError("prompt must be a non-empty string, token id list, or a list of "
                       f"one of those; got {prompt!r:.80}", param="prompt")
    if all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(f"prompt must hold one prompt, got {len(prompt)}: send one request "
                       "per prompt (use n for several completions)", param="prompt")
    for i, tok in enumerate(prompt):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise APIError(f"prompt.{i} must be an integer token id, got {tok!r}",
                           param="prompt")
        _range(0 <= tok < limits.vocab_size, "prompt",
               f"token ids in [0, {limits.vocab_size})", tok)
    return list(prompt)


_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """[{"role", "content"}] with text content; content parts are joined."""
    if not isinstance(messages, list) or not messages:
        raise APIError(f"messages must be a non-empty list, got {messages!r:.80}",
                       param="messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(msg, dict):
            raise APIError(f"{where} must be an object", param=where)
        role = msg.get("role")
        _range(role in _ROLES, f"{where}.role", f"one of {list(_ROLES)}", role)
        # As OpenAI: only an assistant turn may omit its content (it carried tool calls).
        if msg.get("content") is None and role != "assistant":
            raise APIError(f"{where}.content is required for a {role!r} message",
                           param=f"{where}.content", code="missing_required_parameter")
        out.append({"role": role, "content": _message_text(msg.get("content"), where)})
    return out


def _message_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of text parts",
                       param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        ok = (isinstance(part, dict) and part.get("type") == "text"
              and isinstance(part.get("text"), str))
        if not ok:
            raise APIError(f"{where}.content.{j} must be a text part "
                           "({'type': 'text', 'text': ...}); only text is supported",
                           param=f"{where}.content")
        texts.append(part["text"])
    return "".join(texts)


def effective_max_tokens(requested: int | None, default: int | None, num_prompt: int,
                         limits: ServingLimits, prompt_param: str,
                         max_tokens_param: str = "max_tokens") -> int:
    """Refuse a prompt that fills the context, and a requested max_tokens that does not
    fit beside the prompt (as vLLM and OpenAI do: 400 naming all three numbers). An
    omitted max_tokens takes `default` clamped to the room left, or all of it."""
    max_len = limits.max_model_len
    if num_prompt >= max_len:
        raise APIError(
            f"{prompt_param}: this model's maximum context length is {max_len} "
            f"tokens; the prompt has {num_prompt} (it must be < {max_len})",
            param=prompt_param, code="context_length_exceeded")
    room = max_len - num_prompt
    if requested is not None and requested > room:
        raise APIError(
            f"This model's maximum context length is {max_len} tokens. However, you "
            f"requested {num_prompt + requested} tokens ({num_prompt} in the "
            f"{prompt_param}, {requested} in the completion). Please reduce the length "
            f"of the {prompt_param} or {max_tokens_param} (at most {room} here).",
            param=max_tokens_param, code="context_length_exceeded")
    if requested is not None:
        return requested
    return room if default is None else min(default, room)
