"""Offline API: `LLM(...).generate(prompts, SamplingParams)`."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from engine import protocol as P
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.heap import frozen_heap
from engine.output import OutputProcessor, RequestDelta
from engine.tokenizer import Tokenizer
from runner.models.llama import LlamaForCausalLM
from scheduler import Request, SamplingParams
from spec_decode import SpeculativeConfig

if TYPE_CHECKING:
    from engine.data_parallel import DataParallelEngine


@dataclass(frozen=True)
class Logprob:
    """One token's logprob (of the raw logits, as the server reports), its rank among
    the top tokens asked for (None: the sampled token was not among them), and how
    the server names it (text, or "bytes:\\xNN" for part of a UTF-8 character)."""

    logprob: float
    rank: int | None
    decoded_token: str


@dataclass
class CompletionOutput:
    """vLLM's shape: `logprobs[i]` maps token ids to their `Logprob` at output position
    i (the sampled token and the top `SamplingParams.logprobs`); None when not asked."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def add(self, delta: RequestDelta, tokenizer: Tokenizer) -> None:
        """Append one step's tokens, text and logprobs."""
        self.token_ids.extend(delta.new_token_ids)
        self.text += delta.delta_text
        if delta.finished:
            self.finish_reason = delta.finish_reason
        if self.logprobs is None:
            return
        for token_ids, lps in delta.logprobs:
            ranks = {t: r for r, t in enumerate(token_ids[1:], start=1)}
            entry = {token_ids[0]: Logprob(lps[0], ranks.get(token_ids[0]),
                                           tokenizer.logprob_token(token_ids[0]))}
            for t, lp in zip(token_ids[1:], lps[1:], strict=True):
                entry.setdefault(t, Logprob(lp, ranks[t], tokenizer.logprob_token(t)))
            self.logprobs.append(entry)
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + lps[0]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False


def _empty_completion(params: SamplingParams) -> CompletionOutput:
    return CompletionOutput(0, "", [], None, None if params.logprobs is None else [])


class LLM:
    """Generate offline with the engine; `model=None` is the default SmolLM2 model.

    `speculative_config` is a vLLM-style dict, e.g. {"method": "ngram",
    "num_speculative_tokens": 4}; other keyword arguments are EngineConfig fields.
    `data_parallel_size=N > 1` runs N engine replicas on Ray (`ray_address` joins a
    cluster) and spreads the prompts over them (engine/data_parallel.py).
    """

    def __init__(self, model: str | None = None,
                 speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
                 loaded_model: LlamaForCausalLM | None = None, data_parallel_size: int = 1,
                 ray_address: str | None = None, **kwargs: Any) -> None:
        spec = (speculative_config if isinstance(speculative_config, SpeculativeConfig)
                else SpeculativeConfig.from_dict(speculative_config))
        self.config = EngineConfig(model=model, speculative_config=spec, **kwargs)
        self._ids = itertools.count()
        self.replicas: DataParallelEngine | None = None
        if data_parallel_size > 1:
            from engine.data_parallel import DataParallelEngine

            self.replicas = DataParallelEngine(self.config, data_parallel_size, ray_address)
            self.replicas.wait_ready(every=True)
            self.tokenizer = self.replicas.tokenizer
            return
        self.engine = EngineCore(self.config, model=loaded_model)
        self.tokenizer = Tokenizer.from_dir(self.engine.runner.model_path)
        self.processor = OutputProcessor(self.tokenizer)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        params = self._checked_params(sampling_params)
        prepared = self._prepare(prompts)  # every prompt checked before any is queued
        if self.replicas is not None:
            return asyncio.run(self._generate_on_replicas(self.replicas, prepared, params))
        outputs = self._submit(prepared, params)
        with tqdm(total=len(outputs), desc="requests", disable=not use_tqdm) as bar:
            for finished in self._drain(outputs):
                bar.update(finished)
        return list(outputs.values())

    def generate_stepwise(self, prompts: str | list[str] | list[list[int]],
                          sampling_params: SamplingParams | None = None,
                          ) -> Iterator[list[RequestOutput]]:
        """`generate`, one engine step per iteration: yields the outputs so far, in
        prompt order, after each step (the last time, all finished). For a caller that
        drives engines side by side (a benchmark timing two configurations step by
        step on a machine whose speed drifts). Closing it early aborts what is left."""
        if self.replicas is not None:
            raise ValueError("generate_stepwise drives one engine; this LLM has "
                             f"data_parallel_size={len(self.replicas.replicas)} replicas")
        outputs = self._submit(self._prepare(prompts), self._checked_params(sampling_params))
        for _ in self._drain(outputs):
            yield list(outputs.values())

    def _checked_params(self, sampling_params: SamplingParams | None) -> SamplingParams:
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {params!r:.80}")
        for i, token in enumerate(params.stop_token_ids):  # as the server checks them
            if token >= self.tokenizer.vocab_size:
                raise ValueError(f"SamplingParams.stop_token_ids[{i}] must be a token id in "
                                 f"[0, {self.tokenizer.vocab_size}), got {token}")
        return params

    def _submit(self, prepared: list[tuple[str | None, list[int]]],
                params: SamplingParams) -> dict[str, RequestOutput]:
        """Queue every prompt, or none: a refusal drops those already queued."""
        outputs: dict[str, RequestOutput] = {}
        try:
            for text, ids in prepared:
                rid = str(next(self._ids))
                self.engine.add_request(Request(rid, ids, params,
                                                eos_token_id=self.tokenizer.eos_token_id))
                self.processor.add(rid, len(ids), params)
                outputs[rid] = RequestOutput(rid, text, ids, [_empty_completion(params)])
        except BaseException:
            self._drop(outputs)
            raise
        return outputs

    def _drop(self, outputs: dict[str, RequestOutput]) -> None:
        for rid, out in outputs.items():
            if not out.finished:
                self.engine.abort_request(rid)
                self.processor.drop(rid)

    def _drain(self, outputs: dict[str, RequestOutput]) -> Iterator[int]:
        """Step until every request of `outputs` ends, yielding after each step how
        many ended in it. Meanwhile the scheduler knows nobody joins, so its goodput
        policy plans the batch's tail to finish soonest. Left early (an exception, a
        caller that stops iterating), it aborts what is left: no request or KV block
        outlives the call. The heap stays frozen while it steps (engine/heap.py)."""
        self.engine.scheduler.arrivals_closed = True
        try:
            with frozen_heap():
                while self.engine.has_unfinished_requests():
                    yield self._step_into(outputs)
        finally:
            self.engine.scheduler.arrivals_closed = False
            self._drop(outputs)

    def _step_into(self, outputs: dict[str, RequestOutput]) -> int:
        """One engine step, its tokens added to `outputs`; how many requests ended."""
        deltas, stopped, _ = self.processor.process(self.engine.step())
        for rid in stopped:
            self.engine.stop_request(rid)
        finished = 0
        for delta in deltas:
            out = outputs[delta.request_id]
            out.outputs[0].add(delta, self.tokenizer)
            if delta.finished:
                out.finished = True
                finished += 1
        return finished

    def _prepare(self, prompts: Any) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of each prompt, refused as the server refuses a request's
        prompt (the same rules and words; booleans and numeric strings are not token ids),
        as a ValueError naming the prompt's index."""
        items = [prompts] if isinstance(prompts, str) else prompts
        if not isinstance(items, (list, tuple)) or not items:
            raise ValueError("prompts must be a non-empty string, or a non-empty list of "
                             f"strings or token id lists; got {prompts!r:.80}")
        limits = P.ServingLimits("", self.config.max_model_len, self.tokenizer.vocab_size)
        prepared: list[tuple[str | None, list[int]]] = []
        for i, item in enumerate(items):
            if not isinstance(item, (str, list, tuple)):
                raise ValueError(f"prompts[{i}] must be a string or a list of token ids, "
                                 f"got {type(item).__name__} {item!r:.80}")
            try:
                checked = P.prompt_input(list(item) if isinstance(item, tuple) else item,
                                         limits)
            except P.APIError as err:
                raise ValueError(f"prompts[{i}]: {err.message}") from None
            if isinstance(checked, str):
                prepared.append((checked, self.tokenizer.encode(checked)))
            else:
                prepared.append((None, checked))
        return prepared

    async def _generate_on_replicas(self, replicas: DataParallelEngine,
                                    prepared: list[tuple[str | None, list[int]]],
                                    params: SamplingParams) -> list[RequestOutput]:
        """Every prompt at once through the router; a refusal cancels the rest."""
        outputs = [RequestOutput(str(next(self._ids)), text, ids, [_empty_completion(params)])
                   for text, ids in prepared]

        async def run(out: RequestOutput) -> None:
            async for delta in replicas.generate(out.request_id, out.prompt_token_ids,
                                                 params, buffered=True):
                out.outputs[0].add(delta, self.tokenizer)
                if delta.finished:
                    out.finished = True

        try:
            async with asyncio.TaskGroup() as group:
                for out in outputs:
                    group.create_task(run(out))
        except BaseExceptionGroup as errors:  # the first failure, as a single engine raises
            raise errors.exceptions[0] from None
        return outputs

    def close(self) -> None:
        """Stop the replicas (data-parallel); a single engine needs nothing."""
        if self.replicas is not None:
            self.replicas.shutdown()

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation ([{"role", "content"}, ...]) or a list of them, rendered
        with the model's chat template."""
        conversations = (messages if messages and isinstance(messages[0], list)
                         else [messages])
        prompts = []
        for i, conversation in enumerate(conversations):
            try:  # the server's rules and words: roles, content, text parts
                checked = P.chat_messages(conversation)
            except P.APIError as err:
                where = f"conversations[{i}]: " if len(conversations) > 1 else ""
                raise ValueError(where + err.message) from None
            prompts.append(self.tokenizer.apply_chat_template(checked))
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> dict[str, Any]:
        """Scheduler counters and speculative-decoding figures since start (with
        replicas: each replica's state and how many requests it was sent)."""
        if self.replicas is not None:
            return {"replicas": [{**r.describe(), "num_routed": r.num_routed}
                                 for r in self.replicas.replicas]}
        stats = self.engine.scheduler.stats
        return {
            "num_steps": stats.num_steps,
            "num_preemptions": stats.num_preemptions,
            "num_prefix_hit_tokens": stats.num_prefix_hit_tokens,
            "num_scheduled_tokens": stats.num_scheduled_tokens,
            "peak_pass_rows": dict(stats.peak_pass_rows),
            "spec_decode": stats.spec.as_dict(),
            "draft_policy": stats.goodput.as_dict(),
        }
