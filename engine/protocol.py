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
- A prompt of >= `max_model_len` tokens is refused. `max_tokens` is clamped to the room
  the prompt leaves (`max_model_len - prompt tokens`), as vLLM does; omitted, it is 16
  for completions (OpenAI's default) and that room for chat.
- Ranges: temperature [0, 2], top_p (0, 1], top_k -1 or 0 (off) or >= 1, min_p [0, 1],
  n [1, MAX_N], logprobs / top_logprobs [0, MAX_LOGPROBS], at most MAX_STOP stop
  strings (non-empty), seed a 64-bit signed integer, token ids in [0, vocab_size).
- A request the KV cache can never hold is refused by the engine with a ValueError;
  the server maps that to 400 too (`param` null, code `kv_cache_too_small`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_TEMPERATURE = 2.0
INT64 = (-(1 << 63), (1 << 63) - 1)
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


# ---- requests ---------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share; unknown fields are ignored (pydantic's default)."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None  # extension: -1 or 0 = off
    min_p: Number | None = None  # extension
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None  # extension
    seed: StrictInt | None = None
    ignore_eos: StrictBool = False  # extension
    priority: StrictInt = 0  # extension: lower is served first under policy="priority"
    logit_bias: dict[str, Any] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    user: StrictStr | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Any = None  # str, [str], [int], or [[int]]: checked by `prompt_input`
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Any = None  # checked by `chat_messages`
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


class _NonFinite:
    """Stands in for a NaN / Infinity literal while parsing, so its field can be named."""

    def __init__(self, literal: str) -> None:
        self.literal = literal


def _find_non_finite(value: Any, path: str) -> tuple[str, str] | None:
    if isinstance(value, _NonFinite):
        return path, value.literal
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        found = _find_non_finite(item, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def parse_body(raw: bytes, model: type[CompletionRequest] | type[ChatCompletionRequest]
               ) -> Any:
    """Strict JSON (no NaN / Infinity literals), then the pydantic model."""
    try:
        data = json.loads(raw, parse_constant=_NonFinite)
    except ValueError as err:  # UnicodeDecodeError included
        raise APIError(f"Invalid JSON body: {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object", code="invalid_json")
    found = _find_non_finite(data, "")
    if found:
        raise APIError(f"{found[0]}: {found[1]} is not valid JSON (numbers must be finite)",
                       param=found[0], code="invalid_json")
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
    if req.seed is not None:
        _range(INT64[0] <= req.seed <= INT64[1], "seed", "a 64-bit signed integer", req.seed)
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
                         limits: ServingLimits, param: str) -> int:
    """Refuse a prompt that fills the context; clamp max_tokens to the room left."""
    if num_prompt >= limits.max_model_len:
        raise APIError(
            f"{param}: this model's maximum context length is {limits.max_model_len} "
            f"tokens; the prompt has {num_prompt} (it must be < {limits.max_model_len})",
            param=param, code="context_length_exceeded")
    room = limits.max_model_len - num_prompt
    wanted = requested if requested is not None else default
    return room if wanted is None else min(wanted, room)


