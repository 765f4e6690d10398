"""ModelRunner: executes a SchedulerOutput on the model, returns a ModelRunnerOutput.

Per step: assemble every pass the step will build (target, each drafter pass and
one-row step) from the runner's own copy of each request and the method's recipes, and
assert the budget invariant (runner/invariant.py) before any buffer or state write;
sync request state from the output; prepare inputs into the persistent buffers; run the target
forward over the paged KV cache; sample, or verify drafts with the rejection sampler;
then propose the next drafts (token lookup, or drafter passes in the same buffers).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch

from runner.attention import AttentionMetadata, get_attention_backend
from runner.buffers import StepBuffers
from runner.config import DTYPES, RunnerConfig, kv_bytes_per_block
from runner.draft_tree import LeafLogits, compact, leaf_logits_up_front, match_leaves
from runner.feature_capture import FeatureCapture
from runner.input_prep import PreparedStep, prepare_inputs, write_spec_tokens
from runner.invariant import StepFacts, check_step
from runner.min_tokens import before_min_tokens
from runner.model_loader import load_model, pack_for_inference
from runner.model_prep import resolve_model
from runner.models.llama import LlamaForCausalLM
from runner.request_states import RequestStates
from runner.sampler import Sampler, SamplingMetadata, gather_logprobs
from runner.spec import SpecDecoder
from scheduler.config import SchedulerConfig
from scheduler.kv_cache_manager import cdiv
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from spec_decode import SpeculativeConfig
from spec_decode.measured import MeasuredAcceptance
from spec_decode.passes import StepResult, StepRows
from spec_decode.price import DraftPrice

Logprobs = tuple[list[int], list[float]]


def device_memory_bytes(device: torch.device) -> int | None:
    """The device's total memory (physical RAM for the CPU); None where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _logits_rows(step: PreparedStep) -> np.ndarray:
    """Rows of each sampling request's block of logits, in order: 1 + s (s of a tree's
    chain)."""
    return 1 + step.num_chain[step.samples]


def _adopt_model_dtype(config: RunnerConfig, model: LlamaForCausalLM) -> RunnerConfig:
    """A model handed in already has a dtype, and the KV cache and drafter must share
    it: "auto" takes the model's (on a bf16-capable CPU "auto" alone would pick
    bfloat16 for the cache of a float32 model); any other dtype must match it."""
    dtype = model.lm_head.weight.dtype
    if dtype == config.torch_dtype:
        return config
    name = next(key for key in DTYPES if getattr(torch, key) == dtype)
    if config.dtype == "auto":
        return replace(config, dtype=name)
    if config.dtype != name:
        raise ValueError(f"RunnerConfig.dtype={config.dtype!r}, but the loaded model's "
                         f"weights are {name}: pass dtype={name!r} or 'auto'")
    return config


class ModelRunner:
    """Owns the model, the KV cache, the persistent buffers and per-request rows."""

    def __init__(self, config: RunnerConfig, scheduler_config: SchedulerConfig,
                 block_size: int, speculative_config: SpeculativeConfig | None = None,
                 model: LlamaForCausalLM | None = None) -> None:
        """`model`: an already loaded model to share (tests, draft == target); its
        weights' dtype is the run's (see `_adopt_model_dtype`)."""
        if model is None:
            model = load_model(resolve_model(config.model), config.torch_dtype,
                               torch.device(config.device))
        config = _adopt_model_dtype(config, model)
        self.config = config
        self.scheduler_config = scheduler_config
        self.speculative_config = speculative_config
        self.block_size = block_size
        self.device = torch.device(config.device)
        self.model_path = resolve_model(config.model)
        self.model = pack_for_inference(model, self.device, config.quantization)
        self.model_config = model.config
        self.attn = get_attention_backend(config.backend_name)
        self.sampler = Sampler()
        max_blocks = cdiv(scheduler_config.max_model_len, block_size)
        self.buffers = StepBuffers(scheduler_config.max_num_batched_tokens,
                                   scheduler_config.max_num_seqs, max_blocks, self.device)
        self.states = RequestStates(scheduler_config.max_num_seqs,
                                    scheduler_config.max_model_len, max_blocks, self.device)
        # The drafts' tree (a chain unless `draft_top_k` says otherwise: draft_tree.py).
        self.shape = speculative_config.tree_shape if speculative_config else None
        self.spec = (SpecDecoder(speculative_config, model, self.buffers, self.states,
                                 block_size, self.attn, scheduler_config.max_num_batched_tokens,
                                 self.model_path)
                     if speculative_config else None)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Seconds per phase of the last step, when `record_timings` is on (benchmarks).
        self.record_timings = False
        self.last_timings: dict[str, float] = {}
        self.capture: FeatureCapture | None = None  # drafter training data, if attached

    def attach_capture(self, capture: FeatureCapture | None) -> None:
        """Keep every request's target features from now on (None: stop)."""
        if capture is not None and self.spec is not None:
            raise ValueError("feature capture needs speculation off: rows past the "
                             "accepted drafts hold features of rejected tokens")
        self.capture = capture

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

    def kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        per_block = kv_bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                       cfg.head_dim, self.block_size, self.config.torch_dtype)
        return per_block + (self.spec.kv_bytes_per_block() if self.spec else 0)

    def num_kv_blocks(self) -> int:
        """Blocks the configured KV memory buys (target and drafter caches together);
        the engine hands this number to the scheduler's CacheConfig."""
        per_block = self.kv_bytes_per_block()
        available = device_memory_bytes(self.device)
        if available is not None and self.config.kv_cache_memory_bytes > available:
            raise ValueError(f"kv_cache_memory_bytes={self.config.kv_cache_memory_bytes} is more "
                             f"than this {self.device.type} device has ({available} bytes)")
        num_blocks = self.config.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={self.config.kv_cache_memory_bytes} "
                             f"holds no KV block; one block needs {per_block} bytes")
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model_config
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        dtype = self.config.torch_dtype
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device),
             torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]
        if self.spec:
            self.spec.initialize_kv_cache(num_blocks)

    def drafter_acceptance(self) -> MeasuredAcceptance | None:
        """The drafter's acceptance per draft position as measured when it was trained,
        and the verifications behind it (None: no drafter, or none measured); the
        engine hands both to the scheduler's goodput policy as its prior, as it hands
        over the KV size."""
        return self.spec.measured_acceptance if self.spec else None

    @property
    def dtype_description(self) -> str:
        """e.g. "float32 (auto: the CPU has no native bfloat16 ...)"."""
        choice = self.config.dtype_choice
        return f"{self.model.lm_head.weight.dtype} ({choice.reason})".replace("torch.", "")

    @property
    def kernel_description(self) -> str:
        choice = self.model.kernel_choice
        return choice.description if choice else "unpacked"

    @property
    def persistent_buffer_bytes(self) -> int:
        """Bytes of the target's step buffers: the same with speculative decoding on or
        off (drafter passes reuse them)."""
        return self.buffers.nbytes

    @property
    def drafter_buffer_bytes(self) -> int:
        return self.spec.buffer_bytes if self.spec else 0

    # ---- one step ---------------------------------------------------------------

    def _sync_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.states.remove(req_id)
            if self.spec:
                self.spec.remove_request(req_id, req_id in out.finished_req_ids)
        for new in out.scheduled_new_reqs:
            self.states.add(new)
            if self.spec:
                self.spec.add_request(new.req_id, new.prompt_token_ids + new.output_token_ids)
        cached = out.scheduled_cached_reqs
        for rid, block_ids, computed in zip(cached.req_ids, cached.new_block_ids,
                                            cached.num_computed_tokens):
            self.states.update(rid, block_ids, computed)

    def discard(self, out: SchedulerOutput) -> None:
        """Forget every request a failed step touched: whatever `execute` wrote for them
        is not to be trusted. They come back, if at all, as new requests."""
        touched = (set(out.num_scheduled_tokens) | out.finished_req_ids
                   | out.preempted_req_ids | {new.req_id for new in out.scheduled_new_reqs})
        for req_id in touched:
            self.states.remove(req_id)
            if self.spec:
                self.spec.remove_request(req_id, False)
            if self.capture is not None:
                self.capture.discard(req_id)

    def _step_facts(self, out: SchedulerOutput, req_ids: list[str]) -> StepFacts:
        """Each scheduled request's counters as the runner holds them (a new request's
        from its NewRequestData: it gets a row only after the checks), with the KV
        slots it will own once this step's new blocks are appended."""
        states = self.states
        new = {data.req_id: data for data in out.scheduled_new_reqs}
        new_blocks = out.scheduled_cached_reqs.num_new_blocks()
        rows = np.array([0 if rid in new else states.row_of[rid] for rid in req_ids],
                        dtype=np.int64)
        tokens, prompt = states.num_tokens[rows], states.num_prompt[rows]
        computed, limit = states.num_computed[rows], states.max_tokens[rows]
        drafter = states.num_drafter_computed[rows]
        blocks = states.num_blocks[rows] + np.array([new_blocks.get(rid, 0) for rid in req_ids],
                                                    dtype=np.int64)
        for i, rid in enumerate(req_ids):
            if rid in new:
                data = new[rid]
                prompt[i] = len(data.prompt_token_ids)
                tokens[i] = prompt[i] + len(data.output_token_ids)
                computed[i], limit[i] = data.num_computed_tokens, data.sampling_params.max_tokens
                drafter[i] = data.num_drafter_computed_tokens
                blocks[i] = len(data.block_ids)
        spec = out.scheduled_spec_decode_tokens
        s = np.array([len(spec.get(rid, ())) for rid in req_ids], dtype=np.int64)
        return StepFacts(tokens, prompt, computed, limit, s, blocks * self.block_size, drafter)

    def _check_step(self, out: SchedulerOutput, req_ids: list[str], n: np.ndarray,
                    k: np.ndarray) -> StepRows:
        spec = self.speculative_config
        planned = check_step(spec.spec_method if spec else None, out, req_ids, n, k,
                             self._step_facts(out, req_ids),
                             spec.num_speculative_tokens if spec else 0,
                             self.scheduler_config.max_model_len,
                             self.scheduler_config.max_num_batched_tokens,
                             bool(spec and spec.parks))
        self.last_pass_rows = planned.counts
        return planned

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; the output carries its wall time (the goodput draft policy's
        step-time model learns from it)."""
        start = time.perf_counter()
        result = self._execute(out)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result.step_seconds = time.perf_counter() - start
        return result

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        n = np.fromiter(out.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        k = np.array([out.num_draft_tokens.get(r, 0) for r in req_ids], dtype=np.int64)
        # Before anything is written, request state included (DESIGN.md §2).
        planned = self._check_step(out, req_ids, n, k)
        self._sync_states(out)
        if not req_ids:
            return ModelRunnerOutput([], [], {}, pass_rows=self.last_pass_rows)
        spec = out.scheduled_spec_decode_tokens
        num_spec = np.array([len(spec.get(r, ())) for r in req_ids], dtype=np.int64)
        with self._phase("prepare"):
            write_spec_tokens(self.states, spec, self.shape)
            step = prepare_inputs(self.states, self.buffers, req_ids, n, num_spec,
                                  self.block_size, self.shape)
            computed = self.states.num_computed[step.rows].copy()
        with self._phase("forward"):
            hidden, features = self._forward(step)
            if self.capture is not None:
                self.capture.record(step.req_ids, computed, step.num_scheduled, features,
                                    hidden[:step.num_tokens])
            num_leaves = leaf_logits_up_front(step.num_logits, step.num_leaf_logits,
                                              self.model.logits_rows_per_call)
            logits_idx = self.buffers.logits_indices.copy_to_device(step.num_logits + num_leaves)
            logits = self.model.compute_logits(hidden[logits_idx])  # [num_logits (+ leaves), V]
        with self._phase("sample"):
            leaves = LeafLogits(self.buffers.logits_indices.np[step.num_logits:][:num_leaves],
                                logits[step.num_logits:]) if num_leaves else None
            emitted, logprobs, leaf_hits = self._sample(step, logits[:step.num_logits], spec,
                                                        hidden, features, leaves)
            result = self._record(step, computed, emitted, k, planned, out.draft_price)
        with self._phase("draft"):
            # Timed on its own for the goodput policy's step-time model. The sampled
            # tokens are on the host by now (the drafters read them), so on CUDA this
            # start waits for nothing the step does not wait for anyway.
            draft_start = time.perf_counter()
            drafts = (self.spec.propose(result, features, req_ids, planned)
                      if self.spec else {})
            shadows = (self.spec.shadow(result, req_ids, out.shadow_req_ids)
                       if self.spec else {})
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            drafter_seconds = time.perf_counter() - draft_start
        out_tokens: list[list[int]] = [[] for _ in req_ids]
        for j, i in enumerate(np.flatnonzero(step.samples).tolist()):
            out_tokens[i] = emitted[j]
        return ModelRunnerOutput(req_ids, out_tokens, drafts, pass_rows=self.last_pass_rows,
                                 logprobs=logprobs,
                                 drafter_seconds=drafter_seconds if self.spec else None,
                                 shadow_token_ids=shadows, leaf_hits=leaf_hits)

    def _forward(self, step: PreparedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states, and the aux features the drafter's head reads."""
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
        if step.has_leaves:
            meta.tree_prefix = buffers.tree_prefix.copy_to_device(n)
            meta.tree_prefix_cpu = buffers.tree_prefix.np[:n]
        input_ids = buffers.input_ids.copy_to_device(n)
        positions = buffers.positions.copy_to_device(n)
        aux_ids = (self.spec.aux_layer_ids if self.spec
                   else self.capture.aux_layer_ids if self.capture else ())
        return self.model.forward_with_aux(input_ids, positions, self.kv_caches, meta,
                                           self.attn, aux_ids)

    def _sampling_metadata(self, rows: np.ndarray, ahead: np.ndarray | None = None
                           ) -> SamplingMetadata:
        """`ahead`: tokens each row's request emits before this row's (a leaf's bonus)."""
        states = self.states
        seeds = {i: states.seeds[row] for i, row in enumerate(rows.tolist())
                 if row in states.seeds}
        num_logprobs = states.num_logprobs[rows]
        return SamplingMetadata.from_arrays(
            temperature=states.temperature[rows], top_p=states.top_p[rows],
            top_k=states.top_k[rows], min_p=states.min_p[rows], seeds=seeds,
            max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
            device=self.device,
            # where each row's first new token goes
            positions=states.num_tokens[rows] + (0 if ahead is None else ahead),
        )

    def _sample(self, step: PreparedStep, logits: torch.Tensor, spec: dict[str, list[int]],
                hidden: torch.Tensor, features: torch.Tensor, leaves: LeafLogits | None
                ) -> tuple[list[list[int]], dict[str, list[Logprobs]], int]:
        """Tokens emitted per sampling request (in order), logprobs where asked, and
        how many verifications a tree's leaf won."""
        rows = step.rows[step.samples]
        meta = self._sampling_metadata(rows)
        allowed = before_min_tokens(self.states, logits, rows, _logits_rows(step))
        leaf_logits: dict[int, torch.Tensor] = {}
        if spec and self.spec is not None:
            sampling_ids = [step.req_ids[i] for i in np.flatnonzero(step.samples)]
            shape = self.shape
            chains = ({rid: shape.chain_of(d) for rid, d in spec.items()}
                      if step.has_leaves and shape is not None else spec)
            emitted = self.spec.verify(sampling_ids, chains, allowed, meta)
            if step.has_leaves:
                leaf_logits = self._leaf_bonus(step, emitted, [spec.get(r, []) for r in
                                                               sampling_ids], hidden, features,
                                               leaves)
        else:
            emitted = [[t] for t in self.sampler(allowed, meta).sampled_token_ids.tolist()]
        return emitted, self._logprobs(step, logits, emitted, leaf_logits), len(leaf_logits)

    def _leaf_bonus(self, step: PreparedStep, emitted: list[list[int]],
                    drafts: list[list[int]], hidden: torch.Tensor, features: torch.Tensor,
                    leaves: LeafLogits | None) -> dict[int, torch.Tensor]:
        """Where a request's recovered token matched a leaf of its tree, one more token
        sampled from the leaf's row, appended to `emitted`; the leaf's K/V and features
        moved to the chain's place (runner/draft_tree.py). The raw logits of each
        matched leaf's row, by sampling index."""
        sampling = np.flatnonzero(step.samples)
        q_start = np.cumsum(step.num_scheduled) - step.num_scheduled
        first_draft = q_start + step.num_scheduled - step.num_spec
        assert self.shape is not None
        hits = match_leaves(emitted, drafts, self.shape, first_draft[sampling].tolist())
        if not hits.leaf_rows:
            return {}
        logits = (leaves.of(hits.leaf_rows) if leaves is not None else
                  self.model.compute_logits(
                      hidden[torch.as_tensor(hits.leaf_rows, device=hidden.device)]))
        state_rows = step.rows[sampling[hits.sampling_index]]
        ahead = np.array([len(emitted[j]) for j in hits.sampling_index], dtype=np.int64)
        allowed = before_min_tokens(self.states, logits, state_rows,
                                    np.ones(len(state_rows), dtype=np.int64), ahead)
        bonus = self.sampler(allowed, self._sampling_metadata(state_rows, ahead))
        for j, token in zip(hits.sampling_index, bonus.sampled_token_ids.tolist(),
                            strict=True):
            emitted[j].append(token)
        compact(self.kv_caches, self.buffers.slot_mapping.gpu[:step.num_tokens], features, hits)
        return dict(zip(hits.sampling_index, logits, strict=True))

    def _logprobs(self, step: PreparedStep, logits: torch.Tensor,
                  emitted: list[list[int]], leaf_logits: dict[int, torch.Tensor]
                  ) -> dict[str, list[Logprobs]]:
        """Raw-logit logprobs of each emitted token (plus the top n), for requests that
        asked. Emitted token j of a request comes from its j-th logits row; a leaf's
        bonus token (the last) from the leaf's row."""
        asked = self.states.num_logprobs[step.rows[step.samples]]
        if not (asked >= 0).any():
            return {}
        counts = _logits_rows(step)
        starts = np.cumsum(counts) - counts
        sampling_ids = [step.req_ids[i] for i in np.flatnonzero(step.samples)]
        result: dict[str, list[Logprobs]] = {}
        for j, n in enumerate(asked.tolist()):
            if n < 0:
                continue
            from_chain = len(emitted[j]) - (j in leaf_logits)
            row_ids = torch.arange(starts[j], starts[j] + from_chain, device=logits.device)
            rows = logits[row_ids]
            if j in leaf_logits:
                rows = torch.cat([rows, leaf_logits[j][None]])
            tokens = torch.tensor(emitted[j], device=logits.device)
            lp = gather_logprobs(torch.log_softmax(rows, dim=-1), tokens, n)
            result[sampling_ids[j]] = list(zip(lp.token_ids.tolist(), lp.logprobs.tolist(),
                                               strict=True))
        return result

    def _record(self, step: PreparedStep, computed: np.ndarray, emitted: list[list[int]],
                k: np.ndarray, planned: StepRows, price: DraftPrice | None) -> StepResult:
        """Write emitted tokens into the rows; describe the step for the drafter (whose
        KV now holds every valid position, unless the request is parked) and what the
        scheduler priced a draft at (`price`)."""
        states = self.states
        samples = step.samples
        sampling_rows = step.rows[samples]
        counts = np.array([len(t) for t in emitted], dtype=np.int64)
        # [2, 1] tokens from rows at num_tokens [7, 4]: positions [7, 8, 4]
        flat_rows = np.repeat(sampling_rows, counts)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        flat_pos = states.num_tokens[sampling_rows].repeat(counts) + offsets
        states.token_ids[flat_rows, flat_pos] = [t for tokens in emitted for t in tokens]
        states.num_tokens[sampling_rows] += counts
        valid = step.num_scheduled.copy()
        valid[samples] += counts - 1 - step.num_spec[samples]  # L = n - s + accepted
        states.num_computed[step.rows] = computed + valid
        followed = step.rows if planned.parked is None else step.rows[~planned.parked]
        states.num_drafter_computed[followed] = states.num_computed[followed]
        q_start = np.concatenate(([0], np.cumsum(step.num_scheduled)[:-1]))
        catch_up = (planned.catch_up if planned.catch_up is not None
                    else np.zeros_like(computed))
        accepted = np.zeros_like(computed)
        accepted[samples] = counts - 1
        return StepResult(rows=step.rows, computed=computed, num_scheduled=step.num_scheduled,
                          q_start=q_start, valid=valid, samples=samples,
                          num_draft_tokens=np.where(samples, k, 0), catch_up=catch_up,
                          num_spec=step.num_spec, accepted=accepted, draft_price=price)
