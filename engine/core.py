"""EngineCore: one step = schedule -> execute -> update, and recovery from a step that
fails because of one request.

What is recoverable: an exception raised while the runner executes a step (a request
whose parameters slipped past validation, a kernel refusing its input). The step's
requests are preempted and recomputed, nothing they produced so far is lost, and they
run again with at most one *suspect* per step; a fault traced to a single request
finishes that request with finish reason "error" (the server answers it with a 500
error object) and everyone else goes on. What is not: an exception in the scheduler,
a `BudgetInvariantError` (the engine's own contract broke), running out of memory, a
CUDA error (the device context may be corrupt), or `MAX_FAILED_STEPS` failed steps in
a row (a fault no request explains). Those propagate, and the engine dies (503).
"""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from runner.invariant import BudgetInvariantError
from runner.model_runner import ModelRunner
from runner.models.llama import LlamaForCausalLM
from scheduler import CacheConfig, EngineCoreOutput, Request, Scheduler, SchedulerOutput
from scheduler.config import GoodputSettings
from scheduler.request import RequestStatus

logger = logging.getLogger("specbudget.engine")
MAX_FAILED_STEPS = 8  # in a row, before a fault counts as the engine's own


def is_request_level(err: BaseException) -> bool:
    """Whether a fault raised by the runner may be blamed on a request (module doc)."""
    if not isinstance(err, Exception) or isinstance(err, (BudgetInvariantError, MemoryError)):
        return False
    return "CUDA" not in str(err) and "out of memory" not in str(err)


def step_prior_for(device: torch.device) -> str:
    """The goodput policy's step-time prior for a forward on `device`
    (GoodputSettings.step_prior): the CPU's, or a GPU's for any accelerator."""
    return "cpu" if device.type == "cpu" else "gpu"


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
        # A trained head's measured acceptance is the goodput policy's prior: a fresh
        # engine then does not learn by drafting what the head's training measured.
        # The step-time prior by where the forward runs (GoodputSettings.step_prior).
        measured = self.runner.drafter_acceptance()
        prior = step_prior_for(self.runner.device)
        self.scheduler = Scheduler(sched_cfg, cache_cfg, config.speculative_config,
                                   goodput=GoodputSettings(
                                       prior_acceptance=measured.rates,
                                       prior_evidence=measured.verifications,
                                       prior_proposals=measured.proposal_rates,
                                       step_prior=prior)
                                   if measured else GoodputSettings(step_prior=prior))
        self._check_kv_holds_one_request(num_blocks)
        self._failed_steps = 0  # in a row
        logger.info("dtype %s, linear kernel %s", self.runner.dtype_description,
                    self.runner.kernel_description)

    def _check_kv_holds_one_request(self, num_blocks: int) -> None:
        """Refuse to start with a KV cache that cannot hold one max_model_len request:
        it would refuse every request that omits max_tokens (as vLLM refuses)."""
        need = self.scheduler.max_request_blocks()
        if num_blocks >= need:
            return
        cfg, per_block = self.config, self.runner.kv_bytes_per_block()
        have = (f"num_kv_blocks={num_blocks}" if cfg.num_kv_blocks else
                f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes} ({num_blocks} blocks)")
        raise ValueError(
            f"the KV cache cannot hold one request of max_model_len={cfg.max_model_len}: "
            f"it needs {need} blocks of {cfg.block_size} tokens, {need * per_block} bytes "
            f"({need * per_block / (1 << 20):.1f} MiB), and {have} gives fewer. Raise the "
            f"KV cache memory (--kv-cache-memory) to at least {need * per_block} bytes, or "
            f"lower max_model_len.")

    def add_request(self, request: Request) -> None:
        """Queue a request; refuse token ids the model cannot embed (a bad id would
        fail the whole step, and with it every other request in the batch)."""
        vocab = self.runner.model_config.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request.request_id!r}: prompt_token_ids must be in "
                             f"[0, {vocab}); got {bad[:5]}")
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def stop_request(self, request_id: str) -> None:
        """End a request the detokenizer found a stop string in: it finished with
        "stop" for the scheduler too, not as an abort (stats agree with the client)."""
        self.scheduler.abort_request(request_id, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """One step; what each request gained (from the scheduler, the one registry of
        live requests)."""
        output = self.scheduler.schedule()
        try:
            result = self.runner.execute(output)
        except Exception as err:
            if not is_request_level(err) or self._failed_steps + 1 >= MAX_FAILED_STEPS:
                raise
            self._failed_steps += 1
            return self._recover(output, err)
        self._failed_steps = 0
        return self.scheduler.update_from_output(output, result)

    def _recover(self, output: SchedulerOutput, err: Exception) -> list[EngineCoreOutput]:
        """Trace a failed step to one request if it can, and requeue the rest.

        The candidates are the step's suspects, or all its requests if it had none.
        One candidate: it is the culprit. Several: each becomes a suspect and runs as
        the only suspect of its steps, so a repeat of the fault names its request.
        """
        self.runner.discard(output)
        requests = self.scheduler.requests
        step_ids = [rid for rid in output.num_scheduled_tokens if rid in requests]
        candidates = [rid for rid in step_ids if requests[rid].suspect] or step_ids
        culprit = candidates[0] if len(candidates) == 1 else None
        logger.warning("step failed (%r); %s", err, f"traced to request {culprit}" if culprit
                       else f"requeueing {len(step_ids)} requests to trace it")
        for rid in reversed(step_ids):  # each goes to the head of the queue: keep order
            if rid != culprit:
                self.scheduler.requeue(rid, suspect=culprit is None and rid in candidates)
        if culprit is None:
            return []
        self.scheduler.abort_request(culprit, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(culprit, [], True, "error",
                           error=f"the engine failed while running this request: {err!r}")]
