"""OpenAI response bodies and how each endpoint writes them (chunks and final)."""

from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from engine.output import Logprobs, RequestDelta
from scheduler import SamplingParams

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


@dataclass
class Job:
    """One validated API request, ready for the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: list[SamplingParams]  # one per choice
    priority: int
    stream: bool
    include_usage: bool


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: str = ""
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    # Completions logprobs: characters of the tokens reported so far, counted from
    # their UTF-8 bytes (a token holding part of a character adds it once complete).
    text_offset: int = 0
    utf8: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def restart_offsets(self) -> None:
        self.text_offset = 0
        self.utf8.reset()


def sse(data: Any) -> str:
    """One server-sent event of a JSON body (compact, ASCII-escaped)."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


# ---- responses --------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Non-streamed, and (with `usage` None until the end) each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specbudget"
    max_model_len: int
    dtype: str  # what the weights and activations run in ("auto" resolved)
    quantization: str | None = None  # "int8": weights in int8, activations in dtype


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Format:
    """How one endpoint writes choices, chunks and the final response."""

    def __init__(self, model_name: str, tokenizer: Tokenizer, job: Job,
                 num_logprobs: int | None) -> None:
        self.tokenizer = tokenizer
        self.job = job
        self.num_logprobs = num_logprobs  # None: no logprobs asked
        self.model = model_name
        self._templates: dict[tuple[int, str | None], tuple[str, str]] = {}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_string(self, token_id: int) -> str:
        return self.tokenizer.logprob_token(token_id)

    def usage(self, states: list[ChoiceState]) -> UsageInfo:
        prompt = len(self.job.prompt_token_ids)
        completion = sum(s.num_output_tokens for s in states)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                           total_tokens=prompt + completion)

    def start_chunks(self) -> list[dict[str, Any]]:
        return []

    def sse_chunk(self, index: int, delta: RequestDelta, state: ChoiceState) -> str:
        """The SSE event of one delta: `sse(self.chunk(...))`, except that every chunk
        of a choice carries the `created` of its first (as OpenAI's chunks share one).
        Without logprobs, only the text changes between a choice's chunks: the event
        is a template made once per (choice, finish reason) with the text spliced in,
        one string encode per chunk instead of a model built, dumped and encoded."""
        if self.num_logprobs is not None:
            return sse(self.chunk(index, delta, state))
        reason = delta.finish_reason if delta.finished else None
        parts = self._templates.get((index, reason))
        if parts is None:
            parts = self._templates[(index, reason)] = self._template(index, reason, state)
        return parts[0] + json.dumps(delta.delta_text) + parts[1]

    def _template(self, index: int, reason: str | None, state: ChoiceState
                  ) -> tuple[str, str]:
        marker = "\x00text\x00"
        probe = RequestDelta(self.job.request_id, [], marker, reason is not None, reason, 0, 0)
        head, tail = sse(self.chunk(index, probe, state)).split(json.dumps(marker))
        return head, tail

    def chunk(self, index: int, delta: RequestDelta, state: ChoiceState) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo) -> dict[str, Any]:
        raise NotImplementedError

    def response(self, states: list[ChoiceState]) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(Format):
    def logprobs(self, entries: list[Logprobs], state: ChoiceState
                 ) -> CompletionLogprobs | None:
        if self.num_logprobs is None:
            return None
        out = CompletionLogprobs()
        for token_ids, lps in entries:
            out.tokens.append(self.token_string(token_ids[0]))
            out.token_logprobs.append(lps[0])
            top: dict[str, float] = {}
            for t, lp in zip(token_ids[1:], lps[1:], strict=True):
                top.setdefault(self.token_string(t), lp)  # best first: a clash keeps it
            out.top_logprobs.append(top)
            out.text_offset.append(min(state.text_offset, len(state.text)))
            state.text_offset += len(state.utf8.decode(self.tokenizer.token_bytes(token_ids[0])))
        return out

    def chunk(self, index: int, delta: RequestDelta, state: ChoiceState) -> dict[str, Any]:
        choice = CompletionChoice(index=index, text=delta.delta_text,
                                    logprobs=self.logprobs(delta.logprobs, state),
                                    finish_reason=delta.finish_reason if delta.finished else None)
        return CompletionResponse(id=self.job.request_id, model=self.model,
                                    choices=[choice]).model_dump()

    def usage_chunk(self, usage: UsageInfo) -> dict[str, Any]:
        return CompletionResponse(id=self.job.request_id, model=self.model, choices=[],
                                    usage=usage).model_dump()

    def response(self, states: list[ChoiceState]) -> dict[str, Any]:
        choices = []
        for i, state in enumerate(states):
            state.restart_offsets()
            choices.append(CompletionChoice(index=i, text=state.text,
                                              logprobs=self.logprobs(state.logprobs, state),
                                              finish_reason=state.finish_reason))
        return CompletionResponse(id=self.job.request_id, model=self.model, choices=choices,
                                    usage=self.usage(states)).model_dump()


class ChatFormat(Format):
    def logprobs(self, entries: list[Logprobs]) -> ChatLogprobs | None:
        if self.num_logprobs is None:
            return None
        content = []
        for token_ids, lps in entries:
            top = [self._top(t, lp) for t, lp in zip(token_ids[1:], lps[1:], strict=True)]
            first = self._top(token_ids[0], lps[0])
            content.append(ChatTokenLogprob(**first.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        # The token's own bytes: a byte-level token holding part of a character (an
        # emoji is three of them) decodes to U+FFFD, but its bytes joined rebuild it.
        return TopLogprob(token=self.token_text(token_id), logprob=logprob,
                          bytes=list(self.tokenizer.token_bytes(token_id)))

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None
               ) -> dict[str, Any]:
        return ChatCompletionChunk(id=self.job.request_id, model=self.model,
                                     choices=choices, usage=usage).model_dump()

    def start_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk([ChatChunkChoice(
            index=i, delta=DeltaMessage(role="assistant", content=""))])
            for i in range(len(self.job.params))]

    def chunk(self, index: int, delta: RequestDelta, state: ChoiceState) -> dict[str, Any]:
        return self._chunk([ChatChunkChoice(
            index=index, delta=DeltaMessage(content=delta.delta_text),
            logprobs=self.logprobs(delta.logprobs),
            finish_reason=delta.finish_reason if delta.finished else None)])

    def usage_chunk(self, usage: UsageInfo) -> dict[str, Any]:
        return self._chunk([], usage)

    def response(self, states: list[ChoiceState]) -> dict[str, Any]:
        choices = [ChatChoice(index=i, message=ChatMessage(content=s.text),
                                logprobs=self.logprobs(s.logprobs), finish_reason=s.finish_reason)
                   for i, s in enumerate(states)]
        return ChatCompletionResponse(id=self.job.request_id, model=self.model,
                                        choices=choices, usage=self.usage(states)).model_dump()


def apply_delta(state: ChoiceState, delta: RequestDelta) -> None:
    state.text += delta.delta_text
    state.logprobs.extend(delta.logprobs)
    state.num_output_tokens = delta.num_output_tokens
    if delta.finished:
        state.finish_reason = delta.finish_reason
