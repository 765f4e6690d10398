"""OpenAI-compatible HTTP server over an engine (`AsyncEngine`, or `DataParallelEngine`).

`build_app(engine, served_model_name)` gives a FastAPI app with /v1/completions,
/v1/chat/completions (SSE streaming or not), /v1/models, /health and /metrics. Every
request is validated by `engine.protocol` before it reaches the engine; each of its
`n` choices is one engine request (`<id>-<i>`, seeded `seed + i`).

Lifetimes: the engine requests of an API request are closed (hence aborted in the
engine) whenever the response ends early, whichever way: a streaming client that
disconnects, a non-streaming client that disconnects while waiting, a server shutdown.
Engine faults: requests in flight get 500 (or, streamed, an error event then
`[DONE]`); afterwards /health and every new generation request answer 503 at once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine import protocol as P
from engine.connection_limits import ConnectionLimits
from engine.errors import (
    EngineDeadError,
    EngineProcessDiedError,
    EngineShutdownError,
    ReplicaFailedError,
    RequestFailedError,
)
from engine.formats import (
    ChatFormat,
    ChoiceState,
    CompletionFormat,
    Format,
    Job,
    ModelCard,
    ModelList,
    apply_delta,
    sse,
)
from engine.json_body import DEFAULT_MAX_BODY_BYTES
from engine.output import RequestDelta
from engine.serving import ServingEngine
from engine.streams import Choices, ClientGone, EventStream, until_disconnected
from scheduler import SamplingParams

logger = logging.getLogger("specbudget.server")


def _too_large(size: int, limit: int) -> P.APIError:
    return P.APIError(f"Request body of {size} bytes or more exceeds the server's limit of "
                      f"{limit} bytes (--max-request-body-bytes)", status=413,
                      code="request_too_large")


def _engine_error(err: Exception) -> P.APIError:
    """An engine-side failure as the error the client sees."""
    if isinstance(err, RequestFailedError):
        return P.APIError(f"The request failed: {err}", status=500, code="request_failed",
                          type="server_error")
    if isinstance(err, EngineShutdownError):
        return P.APIError(str(err), status=503, code="server_shutting_down",
                          type="server_error")
    if isinstance(err, ReplicaFailedError):
        return P.APIError(f"The engine replica serving this request failed: {err}",
                          status=500, code="replica_failed", type="server_error")
    if isinstance(err, EngineProcessDiedError):  # a new one is being started
        return P.APIError(f"The engine process died: {err}. It is being restarted; "
                          f"retry later", status=503, code="engine_unavailable",
                          type="server_error")
    if isinstance(err, EngineDeadError):
        return P.APIError(f"The engine failed and cannot serve requests: {err}", status=500,
                          code="engine_dead", type="server_error")
    if isinstance(err, ValueError):  # refused at admission, e.g. more KV than the pool
        return P.APIError(str(err), code="kv_cache_too_small")
    return P.APIError(f"Internal error: {err!r}", status=500, code=None, type="server_error")


def _error_response(err: P.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class _OpenAIServer:
    """Turns validated requests into engine requests and engine deltas into responses."""

    def __init__(self, engine: ServingEngine, model_name: str, max_body_bytes: int,
                 body_timeout: float) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        # Set when the server's shutdown timeout passes: bodies still arriving get 503.
        self.closing = asyncio.Event()
        self.limits = P.ServingLimits(model_name, engine.config.max_model_len,
                                      engine.tokenizer.vocab_size)

    # ---- requests -> jobs ---------------------------------------------------------

    def _job(self, prefix: str, req: P.CompletionRequest | P.ChatCompletionRequest,
             prompt_ids: list[int], max_tokens: int, logprobs: int | None) -> Job:
        stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        min_tokens = req.min_tokens or 0
        if min_tokens > max_tokens:
            raise P.APIError(f"min_tokens must be at most max_tokens ({max_tokens}), got "
                             f"{min_tokens}", param="min_tokens")
        params = [SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            min_p=req.min_p or 0.0,
            seed=None if req.seed is None else _wrap_int64(req.seed + i),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos, logprobs=logprobs, stop=stops, min_tokens=min_tokens,
        ) for i in range(req.n)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Job(f"{prefix}-{uuid.uuid4().hex}", prompt_ids, params, req.priority,
                    req.stream, include_usage)

    def _encode(self, text: str, param: str) -> list[int]:
        """Token ids of a prompt; one that cannot fit the context is refused before
        tokenising (no token covers more than a known number of bytes), so a huge
        prompt costs neither seconds of CPU nor the tokenizer's memory."""
        tokenizer, max_len = self.engine.tokenizer, self.limits.max_model_len
        at_least = tokenizer.min_num_tokens(text)
        if at_least >= max_len:
            raise P.APIError(
                f"{param}: this model's maximum context length is {max_len} tokens; the "
                f"prompt has at least {at_least} (it must be < {max_len})", param=param,
                code="context_length_exceeded")
        return tokenizer.encode(text)

    def completion_job(self, raw: bytes) -> tuple[Job, Format]:
        req = P.parse_body(raw, P.CompletionRequest)
        P.check_model(req, self.limits)
        P.check_sampling(req, self.limits)
        P.check_completion_extras(req)
        prompt = P.prompt_input(req.prompt, self.limits)
        ids = self._encode(prompt, "prompt") if isinstance(prompt, str) else prompt
        if not ids:
            raise P.APIError("prompt encodes to no tokens", param="prompt")
        max_tokens = P.effective_max_tokens(req.max_tokens, P.DEFAULT_COMPLETION_MAX_TOKENS,
                                            len(ids), self.limits, "prompt")
        job = self._job("cmpl", req, ids, max_tokens, req.logprobs)
        return job, CompletionFormat(self.model_name, self.engine.tokenizer, job, req.logprobs)

    def chat_job(self, raw: bytes) -> tuple[Job, Format]:
        req = P.parse_body(raw, P.ChatCompletionRequest)
        P.check_model(req, self.limits)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        P.check_sampling(req, self.limits, param)
        P.check_chat_extras(req)
        messages = P.chat_messages(req.messages)
        try:
            text = self.engine.tokenizer.apply_chat_template(messages)
        except Exception as err:  # the template's raise_exception, e.g. bad role order
            raise P.APIError(f"messages: the chat template refused them: {err}",
                             param="messages") from None
        ids = self._encode(text, "messages")
        requested = (req.max_completion_tokens if req.max_completion_tokens is not None
                     else req.max_tokens)
        max_tokens = P.effective_max_tokens(requested, None, len(ids), self.limits, "messages",
                                            param)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        job = self._job("chatcmpl", req, ids, max_tokens, num_logprobs)
        return job, ChatFormat(self.model_name, self.engine.tokenizer, job, num_logprobs)

    # ---- serving ------------------------------------------------------------------

    async def read_body(self, request: Request) -> bytes:
        """The body, within `body_timeout` seconds (else 408) and before the shutdown
        timeout passes (else 503); ClientGone when the client leaves mid-body."""
        reading = asyncio.ensure_future(self._read_all(request))
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            done, _ = await asyncio.wait({reading, closing}, timeout=self.body_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
        if reading in done:
            return reading.result()
        reading.cancel()
        if closing in done:
            raise _engine_error(EngineShutdownError(
                "the server is shutting down: the request body was still arriving"))
        raise P.APIError(f"The request body did not arrive within {self.body_timeout:g} s "
                         "(--body-timeout)", status=408, code="request_timeout")

    async def _read_all(self, request: Request) -> bytes:
        """Refused with 413 once past the limit: from Content-Length before reading
        anything, else as the chunks arrive (never held whole)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(size, limit)
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone() from None
        return b"".join(chunks)

    async def serve(self, request: Request,
                    make_job: Callable[[bytes], tuple[Job, Format]]) -> Response:
        if not self.engine.is_alive:
            _, details = self.engine.health()
            why = details.get("error", "it stopped after a fault")
            state = details.get("engine_state")
            restarting = state == "restarting"
            return _error_response(P.APIError(
                f"The engine is not running ({why})" + ("; it is restarting, retry later"
                                                        if restarting else ""), status=503,
                code="engine_unavailable" if restarting else "engine_dead",
                type="server_error"))
        try:
            raw = await self.read_body(request)
        except ClientGone:  # common and harmless: one quiet line, no traceback
            logger.debug("client %s left before sending its whole body", request.client)
            return Response(status_code=499)
        # Parsing and tokenising a long prompt takes seconds: on a worker thread (the
        # tokenizer releases the GIL), so /health and every stream keep flowing.
        job, fmt = await asyncio.to_thread(make_job, raw)
        choices = Choices(self.engine, job)
        handed_over = False
        try:
            # The first delta (or the engine's refusal) decides the status code, so a
            # request the KV cache can never hold is a 400 even when streamed.
            first = await until_disconnected(request, choices.next())
            if job.stream:
                handed_over = True
                return EventStream(self._events(job, fmt, choices, first), choices.close)
            body = await until_disconnected(request, self._collect(job, fmt, choices, first))
            return JSONResponse(body)
        except (ValueError, EngineDeadError, EngineShutdownError, RequestFailedError,
                ReplicaFailedError) as err:
            return _error_response(_engine_error(err))
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_over:
                choices.close()

    async def _collect(self, job: Job, fmt: Format, choices: Choices,
                       item: tuple[int, RequestDelta] | None) -> dict[str, Any]:
        states = [ChoiceState() for _ in job.params]
        while item is not None:
            apply_delta(states[item[0]], item[1])
            item = await choices.next()
        return fmt.response(states)

    async def _events(self, job: Job, fmt: Format, choices: Choices,
                      item: tuple[int, RequestDelta] | None) -> AsyncIterator[str]:
        states = [ChoiceState() for _ in job.params]
        try:
            for chunk in fmt.start_chunks():
                yield sse(chunk)
            while item is not None:
                index, delta = item
                apply_delta(states[index], delta)
                if delta.delta_text or delta.finished or delta.logprobs:
                    yield fmt.sse_chunk(index, delta, states[index])
                item = await choices.next()
            if job.include_usage:
                yield sse(fmt.usage_chunk(fmt.usage(states)))
        except Exception as err:
            logger.warning("stream %s failed: %r", job.request_id, err)
            yield sse(_engine_error(err).body())
        yield "data: [DONE]\n\n"


def _wrap_int64(value: int) -> int:
    """seed + i stays a 64-bit signed integer (wraps around at the top)."""
    return (value - P.INT64[0]) % (1 << 64) + P.INT64[0]


def wire_engine_metrics(engine: ServingEngine, registry: CollectorRegistry,
                        model_name: str) -> Callable[[], None]:
    """Export the engine's `specbudget:*` metrics on `registry`; returns the undo."""
    return engine.export_metrics(registry, model_name)


def build_app(engine: ServingEngine, served_model_name: str,
              registry: CollectorRegistry | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              limits: ConnectionLimits | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine`; see the module docstring. `limits`:
    the body timeout is the app's; the rest is the HTTP protocol's (local_server)."""
    registry = registry if registry is not None else CollectorRegistry()
    limits = limits or ConnectionLimits()
    server = _OpenAIServer(engine, served_model_name, max_request_body_bytes,
                           limits.body_timeout)
    unwire = wire_engine_metrics(engine, registry, served_model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            unwire()  # the engine may outlive this app (tests serve it again)

    app = FastAPI(title="specbudget", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.registry = registry
    app.state.limits = limits
    app.state.closing = server.closing  # set by DrainingServer at its shutdown timeout
    _add_error_handlers(app)

    # The handlers read the raw body (strict JSON first), so the request models are
    # declared to OpenAPI by hand: clients and fuzzers see what is accepted.
    @app.post("/v1/completions", openapi_extra=_body_schema(P.CompletionRequest))
    async def completions(request: Request) -> Response:
        return await server.serve(request, server.completion_job)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(P.ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await server.serve(request, server.chat_job)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=served_model_name, max_model_len=engine.config.max_model_len,
                         dtype=engine.config.runner_config().dtype_choice.dtype,
                         quantization=engine.config.quantization)
        return ModelList(data=[card]).model_dump()

    @app.get("/health")
    async def health() -> Response:
        serving, details = engine.health()
        if serving:
            return JSONResponse(details) if details else Response(status_code=200)
        details = dict(details)
        why = details.pop("error", None)  # in the error object's message, not over it
        body = P.APIError("The engine is not running" + (f": {why}" if why else ""),
                          status=503, code="engine_dead", type="server_error").body()
        return JSONResponse({**body, **details}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _body_schema(model: type[P.CompletionRequest] | type[P.ChatCompletionRequest]
                 ) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": P.request_schema(model)}}}}


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, routing ones included, as an OpenAI error object."""

    @app.exception_handler(P.APIError)
    async def api_error(_: Request, err: P.APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        what = {404: "Not found", 405: "Method not allowed"}.get(err.status_code, err.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        message = f"{what}: {request.method} {request.url.path}"
        response = _error_response(P.APIError(message, status=err.status_code, code=code))
        response.headers.update(err.headers or {})  # 405 carries Allow
        return response

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error_response(P.APIError(f"Internal error: {err!r}", status=500, code=None,
                                          type="server_error"))
