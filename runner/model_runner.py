"""ModelRunner: executes a SchedulerOutput on the model, returns a ModelRunnerOutput.

Per step: sync request state from the output, count the passes and assert the budget
invariant (before any buffer write), prepare inputs into the persistent buffers, run
the forward pass over the paged KV cache, sample, and report.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from runner.attention import AttentionMetadata, get_attention_backend
from runner.buffers import StepBuffers
from runner.config import RunnerConfig, kv_bytes_per_block
from runner.input_prep import PreparedStep, prepare_inputs, write_spec_tokens
from runner.invariant import check_pass_rows
from runner.model_loader import load_model
from runner.model_prep import resolve_model
from runner.models.llama import LlamaForCausalLM
from runner.request_states import RequestStates
from runner.sampler import Sampler, SamplerOutput, SamplingMetadata
from scheduler.config import SchedulerConfig
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from spec_decode import SpeculativeConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ModelRunner:
    """Owns the model, the KV cache, the persistent buffers and per-request rows."""

    def __init__(self, config: RunnerConfig, scheduler_config: SchedulerConfig,
                 block_size: int, speculative_config: SpeculativeConfig | None = None,
                 model: LlamaForCausalLM | None = None) -> None:
        """`model`: an already loaded model to share (tests, draft == target)."""
        self.config = config
        self.scheduler_config = scheduler_config
        self.speculative_config = speculative_config
        self.block_size = block_size
        self.device = torch.device(config.device)
        if model is None:
            model = load_model(resolve_model(config.model), config.torch_dtype, self.device)
        self.model = model
        self.model_config = model.config
        self.attn = get_attention_backend(config.backend_name)
        self.sampler = Sampler()
        max_blocks = cdiv(scheduler_config.max_model_len, block_size)
        self.buffers = StepBuffers(scheduler_config.max_num_batched_tokens,
                                   scheduler_config.max_num_seqs, max_blocks, self.device)
        self.states = RequestStates(scheduler_config.max_num_seqs,
                                    scheduler_config.max_model_len, max_blocks, self.device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Seconds per phase of the last step, when `record_timings` is on (benchmarks).
        self.record_timings = False
        self.last_timings: dict[str, float] = {}

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        if not self.record_timings:
            yield
            return
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_timings[name] = time.perf_counter() - start

    # ---- KV cache ---------------------------------------------------------------

    def num_kv_blocks(self) -> int:
        """Blocks the configured KV memory buys; the engine hands this to the scheduler."""
        cfg = self.model_config
        per_block = kv_bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                       cfg.head_dim, self.block_size, self.config.torch_dtype)
        num_blocks = self.config.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={self.config.kv_cache_memory_bytes} "
                             f"holds no KV block; one block needs {per_block} bytes")
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model_config
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device),
             torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]

    @property
    def persistent_buffer_bytes(self) -> int:
        """Bytes of the step buffers; independent of speculative decoding."""
        return self.buffers.nbytes

    # ---- one step ---------------------------------------------------------------

    def _sync_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.states.remove(req_id)
        for new in out.scheduled_new_reqs:
            self.states.add(new)
        for cached in out.scheduled_cached_reqs:
            self.states.update(cached)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._sync_states(out)
        req_ids = list(out.num_scheduled_tokens)
        num_scheduled = np.fromiter(out.num_scheduled_tokens.values(), dtype=np.int64,
                                    count=len(req_ids))
        # Count the target pass from what we were asked to build, then assert, before
        # any buffer is written.
        check_pass_rows(out.spec_method, out.max_num_batched_tokens,
                        {"target": int(num_scheduled.sum())}, 0)
        if not req_ids:
            return ModelRunnerOutput([], [], {}, pass_rows={"target": 0})
        if out.scheduled_spec_decode_tokens:
            raise NotImplementedError("draft verification lands with spec_decode proposers")
        num_spec = np.zeros(len(req_ids), dtype=np.int64)
        with self._phase("prepare"):
            write_spec_tokens(self.states, out.scheduled_spec_decode_tokens)
            step = prepare_inputs(self.states, self.buffers, req_ids, num_scheduled, num_spec,
                                  self.block_size)
        with self._phase("forward"):
            hidden = self._forward(step)
            logits_idx = self.buffers.logits_indices.copy_to_device(step.num_logits)
            logits = self.model.compute_logits(hidden[logits_idx])  # [num_logits, V]
        with self._phase("sample"):
            sampled = self._sample(step, logits)
            return self._finish_step(step, sampled)

    def _forward(self, step: PreparedStep) -> torch.Tensor:
        buffers, n, num_reqs = self.buffers, step.num_tokens, len(step.req_ids)
        meta = AttentionMetadata(
            num_actual_tokens=n,
            num_reqs=num_reqs,
            query_start_loc=buffers.query_start_loc.copy_to_device(num_reqs + 1),
            seq_lens=buffers.seq_lens.copy_to_device(num_reqs),
            block_table=buffers.block_table.copy_to_device(num_reqs),
            slot_mapping=buffers.slot_mapping.copy_to_device(n),
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            query_start_loc_cpu=buffers.query_start_loc.np[:num_reqs + 1].tolist(),
            seq_lens_cpu=buffers.seq_lens.np[:num_reqs].tolist(),
        )
        input_ids = buffers.input_ids.copy_to_device(n)
        positions = buffers.positions.copy_to_device(n)
        return self.model(input_ids, positions, self.kv_caches, meta, self.attn)

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        states = self.states
        generators = {i: states.generators[row] for i, row in enumerate(rows.tolist())
                      if row in states.generators}
        num_logprobs = states.num_logprobs[rows]
        return SamplingMetadata.from_arrays(
            temperature=states.temperature[rows], top_p=states.top_p[rows],
            top_k=states.top_k[rows], min_p=states.min_p[rows], generators=generators,
            max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
            device=self.device,
        )

    def _sample(self, step: PreparedStep, logits: torch.Tensor) -> SamplerOutput:
        rows = step.rows[step.samples]
        return self.sampler(logits, self._sampling_metadata(rows))

    def _finish_step(self, step: PreparedStep, sampled: SamplerOutput) -> ModelRunnerOutput:
        """Record sampled tokens in the rows and build the output in scheduled order."""
        states = self.states
        tokens = sampled.sampled_token_ids.tolist()
        states.num_computed[step.rows] += step.num_scheduled
        sampling_rows = step.rows[step.samples]
        states.token_ids[sampling_rows, states.num_tokens[sampling_rows]] = tokens
        states.num_tokens[sampling_rows] += 1
        out_tokens: list[list[int]] = [[] for _ in step.req_ids]
        logprobs: dict[str, tuple[list[int], list[float]]] = {}
        for j, i in enumerate(np.flatnonzero(step.samples).tolist()):
            out_tokens[i] = [tokens[j]]
            if sampled.logprobs is not None and states.num_logprobs[step.rows[i]] >= 0:
                n = int(states.num_logprobs[step.rows[i]]) + 1
                logprobs[step.req_ids[i]] = (
                    sampled.logprobs.token_ids[j, :n].tolist(),
                    sampled.logprobs.logprobs[j, :n].tolist(),
                )
        return ModelRunnerOutput(step.req_ids, out_tokens, {},
                                 pass_rows={"target": step.num_tokens}, logprobs=logprobs)
