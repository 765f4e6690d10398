"""EngineCore: one step = schedule -> execute -> update."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from runner.model_runner import ModelRunner
from runner.models.llama import LlamaForCausalLM
from scheduler import CacheConfig, Request, Scheduler


@dataclass
class StepUpdate:
    """New tokens of one request this step, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    # One (token ids, logprobs) per new token, for requests that asked for logprobs.
    logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)


class EngineCore:
    """Owns the scheduler and the runner; the KV size found at start goes to both."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM | None = None) -> None:
        self.config = config
        sched_cfg = config.scheduler_config()
        self.runner = ModelRunner(config.runner_config(), sched_cfg, config.block_size,
                                  config.speculative_config, model=model)
        num_blocks = config.num_kv_blocks or self.runner.num_kv_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        cache_cfg = CacheConfig(config.block_size, num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(sched_cfg, cache_cfg, config.speculative_config)
        self._live: dict[str, tuple[Request, int]] = {}  # request, outputs reported

    def add_request(self, request: Request) -> None:
        """Queue a request; refuse token ids the model cannot embed (a bad id would
        fail the whole step, and with it every other request in the batch)."""
        vocab = self.runner.model_config.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request.request_id!r}: prompt_token_ids must be in "
                             f"[0, {vocab}); got {bad[:5]}")
        self.scheduler.add_request(request)
        self._live[request.request_id] = (request, 0)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)
        self._live.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[StepUpdate]:
        output = self.scheduler.schedule()
        result = self.runner.execute(output)
        self.scheduler.update_from_output(output, result)
        return self._collect(output.num_scheduled_tokens, result.logprobs)

    def _collect(self, scheduled: dict[str, int],
                 logprobs: dict[str, list[tuple[list[int], list[float]]]]
                 ) -> list[StepUpdate]:
        updates = []
        for rid in scheduled:
            entry = self._live.get(rid)
            if entry is None:
                continue
            request, reported = entry
            new = request.output_token_ids[reported:]
            finished = request.is_finished()
            if new or finished:
                # A stop condition may have dropped tokens after it: keep theirs aligned.
                lps = logprobs.get(rid, [])[:len(new)]
                updates.append(StepUpdate(rid, new, finished, request.finish_reason, lps))
            if finished:
                del self._live[rid]
            else:
                self._live[rid] = (request, reported + len(new))
        return updates
