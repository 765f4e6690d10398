"""Model-based drafting inside the runner's budgeted buffers: the `ModelDrafter` behind
the "head" and "lm" drafter kinds (runner/drafters.py), and the networks they run.

After verification, the drafter fills the method's passes (spec_decode/passes.py),
whose rows the runner assembled and checked before the step, into the runner's
persistent step buffers (sized by B; the target pass is done with them) plus its own
hidden-state buffer of B rows, runs its network over its own paged KV cache, and reads
greedy drafts. Greedy drafting makes q one-hot at each draft, so the rejection sampler
needs no draft probabilities and stays lossless.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from runner.attention import AttentionBackend, AttentionMetadata
from runner.buffers import StepBuffers
from runner.config import kv_bytes_per_block
from runner.draft_calibration import DraftCalibration
from runner.draft_gate import ConfidenceGate
from runner.draft_models import DraftLM, KVCache
from runner.eagle3 import Eagle3Config, Eagle3Head, load_eagle3, trained_head_dir
from runner.invariant import check_filled
from runner.model_loader import load_model
from runner.model_prep import DEFAULT_MODEL_NAME, resolve_model
from runner.models.linear_draft import draft_kernel
from runner.models.llama import LlamaConfig, LlamaForCausalLM
from runner.request_states import RequestStates
from spec_decode import SpeculativeConfig, get_method
from spec_decode.measured import MeasuredAcceptance
from spec_decode.passes import (
    MASK_ROW,
    DraftPass,
    ReadoutBlock,
    StepResult,
    StepRows,
    fill_pass,
    sequential_positions,
)

RANDOM_HEAD = "random"  # `"model": "random"`: an untrained head, for layouts and benchmarks
# A pass with at least this many rows that read out no draft runs as two calls: every
# row's K/V (`write_kv`), then the whole layer over its readout rows alone. A prompt
# chunk or a catch-up reads out one row of tens or hundreds; a decode pass of a few
# rows runs whole, where the second call costs more than the rows it skips (measured,
# eagle's trained head in bfloat16, one request, split against whole: 1.33x at 2 rows,
# 1.19x at 8, 0.97x at 16, 0.63x at 64, 0.47x at 128).
SPLIT_MIN_SKIPPED = 16
RANDOM_HEAD_VOCAB = 8192


def find_trained_head(target_path: Path | None, method: str) -> Path | None:
    """The head `specbudget train-drafter` wrote for this target and method, else for
    the method whose head it shares (`SpecMethod.trained_heads`: mtp serves with
    eagle's), or None."""
    if target_path is None:
        return None
    for name in get_method(method).trained_heads:
        found = trained_head_dir(target_path, name)
        if (found / "config.json").is_file() and (found / "model.safetensors").is_file():
            return found
    return None


class NoTrainedHeadError(ValueError):
    """A head method was asked for without a head, and none was trained for the target."""


def missing_head_message(method: str, target_path: Path | None) -> str:
    where = (f" at {trained_head_dir(target_path, method)}" if target_path is not None
             else "")
    target = f" for {target_path.name}" if target_path is not None else ""
    return (f"speculative_config: method {method!r} needs a trained draft head{target} and "
            f"none was found{where}. Train one with `specbudget train-drafter --method "
            f"{method}` (about 30 minutes on 2 CPU cores), pass a head's directory as "
            f"speculative_config's \"model\", or ask for an untrained head with \"model\": "
            f"\"{RANDOM_HEAD}\" (its drafts are rejected: for layout tests and benchmarks)")


def make_head(spec: SpeculativeConfig, target: LlamaForCausalLM,
              target_path: Path | None) -> Eagle3Head:
    """An EAGLE-3 head: from the checkpoint dir `spec.model`; without one, the trained
    default head; a random one only when asked for by name."""
    model = spec.model
    if model in (None, DEFAULT_MODEL_NAME):
        trained = find_trained_head(target_path, spec.method)
        if trained is None:
            raise NoTrainedHeadError(missing_head_message(spec.method, target_path))
        model = str(trained)
    if model == RANDOM_HEAD:
        config = Eagle3Config.for_target(target.config,
                                         min(RANDOM_HEAD_VOCAB, target.config.vocab_size))
        head = Eagle3Head(config, target, seed=int(spec.options.get("seed", 0)))
    else:
        head = load_eagle3(Path(str(model)), target)
    weight = target.lm_head.weight
    head = head.to(device=weight.device, dtype=weight.dtype)
    if target.kernel_choice is not None:
        # a head's drafts are verified, so its calls need not be row-invariant
        head.pack(draft_kernel(target.kernel_choice.kernel, weight.dtype))
    return head


def make_draft_lm(spec: SpeculativeConfig, target: LlamaForCausalLM) -> DraftLM:
    """The draft LM `spec.model` names; by default the target drafts for itself."""
    if spec.model in (None, DEFAULT_MODEL_NAME):
        return DraftLM(target)  # the default model drafts for itself: shared weights
    weight = target.lm_head.weight
    draft = load_model(resolve_model(spec.model), weight.dtype, weight.device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft model {spec.model!r} has vocab_size "
                         f"{draft.config.vocab_size}, the target {target.config.vocab_size}: "
                         "a draft must share the target's tokenizer")
    if target.kernel_choice is not None:
        draft.pack(target.kernel_choice)  # only once the draft is accepted
    return DraftLM(draft)


class DraftNet(Protocol):
    """The network a `ModelDrafter` runs (`Eagle3Head`, `DraftLM`)."""

    @property
    def config(self) -> LlamaConfig: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose inputs the net reads; empty: it reads no target features."""
        ...

    def write_context_hidden(self, out: torch.Tensor, features: torch.Tensor,
                             hidden_src: np.ndarray) -> None:
        """Fill `out` [R, H], a pass's hidden inputs, from the target's `features`."""

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def drafts_with_confidence(self, hidden: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`greedy_tokens` and each draft's probability under the net ([N] fp32)."""
        ...

    def top_drafts(self, hidden: torch.Tensor, top_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's `top_k` candidates, the greedy draft first, and its probability."""
        ...

    def __call__(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[KVCache], meta: AttentionMetadata,
                 attn: AttentionBackend) -> torch.Tensor: ...

    def write_kv(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[KVCache], meta: AttentionMetadata,
                 attn: AttentionBackend) -> None:
        """What `__call__` writes to the KV caches, the same bits, and nothing else."""


class ModelDrafter:
    """Runs a model-based method's drafter passes and returns each request's drafts
    (a `Drafter`, runner/drafters.py)."""

    def __init__(self, spec: SpeculativeConfig, net: DraftNet, target: LlamaForCausalLM,
                 buffers: StepBuffers, states: RequestStates, block_size: int,
                 attn: AttentionBackend, max_num_batched_tokens: int,
                 min_confidence: float = 0.0, priced: bool = False) -> None:
        self.method = spec.spec_method
        # Where a chain stops short of its k (runner/draft_gate.py); 0: never. Where
        # `priced`, on steps the scheduler prices a draft, by what its next draft is
        # learnt to gain instead (runner/draft_calibration.py).
        self.min_confidence = min_confidence
        self.calibration = DraftCalibration() if priced else None
        # Candidates per depth (a drafted tree: runner/draft_tree.py).
        self.shape = spec.tree_shape
        self.parks = spec.parks
        self.net = net
        self.buffers, self.states, self.block_size, self.attn = buffers, states, block_size, attn
        cfg = self.net.config
        weight = target.lm_head.weight
        # The drafter's own buffer: at most B rows, like every other.
        self.hidden = torch.zeros(max_num_batched_tokens, cfg.hidden_size,
                                  dtype=weight.dtype, device=weight.device)  # [B, H]
        self.mask_id = int(spec.options.get("mask_token_id", 0))
        self.kv_caches: list[KVCache] = []
        # The target's features at every KV slot a parked request computed, for the
        # rows that catch up when it drafts again (a head's input; a draft LM reads
        # tokens only and keeps none). Paged like the KV, in the same blocks.
        self.feature_dim = len(net.aux_layer_ids) * target.config.hidden_size
        self.feature_cache: torch.Tensor | None = None  # [num_blocks * block_size, F]

    @property
    def measured_acceptance(self) -> MeasuredAcceptance | None:
        """A trained head's acceptance per position as measured in training; None for a
        draft LM or a head that came without it. Its chains' reach only where it was
        measured with the gate this drafter serves with (another threshold stops other
        chains)."""
        # A priced gate keeps the default threshold's reach as its prior: nearer what
        # its chains reach than every chain drawn whole (the policy learns the rest).
        measured: MeasuredAcceptance | None = getattr(self.net, "measured_acceptance", None)
        if measured is not None and measured.gate != self.min_confidence:
            return measured._replace(proposal_rates=(), gate=self.min_confidence)
        return measured

    def kv_bytes_per_block(self) -> int:
        cfg = self.net.config
        features = (self.block_size * self.feature_dim * self.hidden.element_size()
                    if self.parks else 0)
        return kv_bytes_per_block(self.net.num_layers, cfg.num_key_value_heads, cfg.head_dim,
                                  self.block_size, self.hidden.dtype) + features

    def initialize_kv_cache(self, num_blocks: int) -> None:
        cfg = self.net.config
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        dtype, device = self.hidden.dtype, self.hidden.device
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(self.net.num_layers)]
        if self.feature_dim and self.parks:
            self.feature_cache = torch.zeros(num_blocks * self.block_size, self.feature_dim,
                                             dtype=dtype, device=device)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose inputs the head reads (none for a draft LM)."""
        return self.net.aux_layer_ids

    @property
    def buffer_bytes(self) -> int:
        return self.hidden.numel() * self.hidden.element_size()

    def add_request(self, req_id: str, token_ids: list[int]) -> None:
        """Nothing to keep: a request's KV lives in the runner's block tables."""

    def remove_request(self, req_id: str, finished: bool) -> None:
        """Its chain's record, if a priced gate keeps one (its KV: see `add_request`)."""
        if self.calibration is not None:
            self.calibration.forget(req_id)

    def propose(self, res: StepResult, target_features: torch.Tensor, req_ids: list[str],
                planned: StepRows) -> dict[str, list[int]]:
        """Next drafts for every request that samples with k >= 1.

        `target_features`: the target's aux features per target-pass row (a head's
        input; unused by a draft LM). `planned`: the rows of every pass, assembled and
        checked before the step wrote anything; now filled with what verification
        left, and checked again so that no request reads outside its own rows.
        """
        if planned.parked is not None and planned.parked.any():
            self._stash_features(res, target_features, planned.parked)
        # The drafts verified this step teach the record before this step's gate reads it.
        calibration = self.calibration
        if calibration is not None and res.num_spec is not None and res.accepted is not None:
            calibration.learn(req_ids, res.num_spec, res.accepted, res.samples)
        gate = self._gate(res)
        by_index = self._draft(res, target_features, planned, gate)
        proposed = {req_ids[i]: drafts[:int(res.num_draft_tokens[i])]
                    for i, drafts in by_index.items()}
        if calibration is not None:
            for i in by_index:
                rid = req_ids[i]
                calibration.remember(rid, gate.products.get(i, [])[:len(proposed[rid])])
        return proposed

    def _gate(self, res: StepResult) -> ConfidenceGate:
        """This step's gate: priced where the scheduler priced a draft and the drafter
        learns what drafts gain, else at `min_confidence` (recording its chains where
        the drafter learns)."""
        calibration = self.calibration
        if calibration is None:
            return ConfidenceGate(self.min_confidence)
        if res.draft_price is None:
            return ConfidenceGate(self.min_confidence, record=True)
        return ConfidenceGate(self.min_confidence, priced=calibration.going_on(res.draft_price))

    def shadow(self, res: StepResult, req_ids: list[str],
               wanted: list[str]) -> dict[str, int]:
        """None: a model's draft costs its passes' rows (the scheduler asks for none)."""
        return {}

    def _stash_features(self, res: StepResult, target_features: torch.Tensor,
                        parked: np.ndarray) -> None:
        """Keep the target's features of each parked request's valid rows (positions
        c .. c + L - 1) in the feature cache, at their KV slots."""
        if self.feature_cache is None:
            return
        if parked.all() and np.array_equal(res.valid, res.num_scheduled):
            # Every row of the target pass is a parked request's kept row (a step
            # nobody drafts in or verifies, most steps under load): the slots are the
            # target pass's own, still in the step buffers (the drafter's passes
            # refill them after this). Measured in place at 16 running: 113 -> 61 us.
            rows = len(target_features)
            self.feature_cache.index_copy_(0, self.buffers.slot_mapping.gpu[:rows],
                                           target_features)
            return
        self._stash_rows(res, target_features, parked)

    def _stash_rows(self, res: StepResult, target_features: torch.Tensor,
                    parked: np.ndarray) -> None:
        """`_stash_features` for any step: each parked request's valid rows' slots
        from its block table."""
        assert self.feature_cache is not None
        reqs = np.flatnonzero(parked & (res.valid > 0))
        counts = res.valid[reqs]
        if (counts == 1).all():  # decoding: one row each (most steps)
            positions, src, rows = res.computed[reqs], res.q_start[reqs], res.rows[reqs]
        else:
            offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            positions = np.repeat(res.computed[reqs], counts) + offset
            src = np.repeat(res.q_start[reqs], counts) + offset
            rows = np.repeat(res.rows[reqs], counts)
        slots = self._slots(rows, positions)
        device = self.feature_cache.device
        self.feature_cache[torch.as_tensor(slots, device=device)] = \
            target_features[torch.as_tensor(src, device=device)]

    def _slots(self, state_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        blocks = self.states.block_table[state_rows, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _draft(self, res: StepResult, target_features: torch.Tensor,
               planned: StepRows, gate: ConfidenceGate) -> dict[int, list[int]]:
        """Drafts per scheduled-request index, for every request with k >= 1."""
        drafts: dict[int, list[int]] = {int(i): [] for i in np.flatnonzero(res.num_draft_tokens)}
        if not any(rows for name, rows in planned.counts.items() if name != "target"):
            return drafts  # every request parked: no pass to fill (most steps under load)
        last_hidden: dict[int, torch.Tensor] = {}
        chain: dict[int, int] = {}  # each request's newest greedy draft
        passes = [fill_pass(rows, res, self.states.token_ids, self.mask_id)
                  for rows in planned.passes]
        for draft_pass in passes:
            check_filled(self.method.name, draft_pass, res.q_start, res.num_scheduled,
                         res.computed)
        # Checked as charged, run without the padding over rejected drafts.
        for draft_pass in (p.without_padding() for p in passes):
            if draft_pass.num_rows == 0:
                continue
            read = self._run(draft_pass, res, target_features)
            if read is not None:
                reqs = draft_pass.req_index[draft_pass.readout].tolist()
                tokens = gate.drafts(self.net, read, reqs, self._widths(reqs))
                for req, candidates, h in zip(reqs, tokens, read, strict=True):
                    drafts[req] += candidates
                    chain[req] = candidates[0]
                    last_hidden[req] = h
        if self.method.sequential:
            self._sequential(res, drafts, chain, last_hidden, gate)
        return drafts

    def _widths(self, reqs: list[int]) -> list[int] | None:
        """Candidates each readout row lists: a request's readout rows read its depths
        in order from the first (None: a chain's one each)."""
        return None if self.shape.is_chain else self.shape.readout_widths(reqs)

    def _sequential(self, res: StepResult, drafts: dict[int, list[int]], chain: dict[int, int],
                    last_hidden: dict[int, torch.Tensor], gate: ConfidenceGate) -> None:
        """Up to k - 1 one-row steps (a tree's depth - 1): each drafting request feeds
        its newest greedy draft back, while the gate lets its chain go on."""
        depth = self.shape.depth(res.num_draft_tokens)
        for j in range(1, int(depth.max(initial=0))):
            reqs = gate.still_drafting(np.flatnonzero(depth > j), j)
            if not len(reqs):
                break  # every chain stopped: the passes left are not run
            positions = sequential_positions(self.method, res, j)[reqs]
            tokens = np.array([chain[int(r)] for r in reqs], dtype=np.int64)
            one_row = np.zeros(len(res.rows), dtype=np.int64)
            one_row[reqs] = 1
            starts = np.zeros(len(res.rows), dtype=np.int64)
            starts[reqs] = positions
            step = DraftPass(f"step_{j}", reqs, positions, tokens,
                             np.full(len(reqs), MASK_ROW), one_row, starts,
                             np.arange(len(reqs)), one_row, np.zeros(len(reqs), dtype=bool))
            hidden = torch.stack([last_hidden[int(r)] for r in reqs])
            out = self._run(step, res, hidden, direct_hidden=True)
            assert out is not None
            tokens_out = gate.drafts(self.net, out, reqs.tolist(),
                                     None if self.shape.is_chain
                                     else [self.shape.width(j + 1)] * len(reqs))
            for i, r in enumerate(reqs.tolist()):
                drafts[r] += tokens_out[i]
                chain[r] = tokens_out[i][0]
                last_hidden[r] = out[i]

    def _run(self, draft_pass: DraftPass, res: StepResult, hidden_in: torch.Tensor,
             direct_hidden: bool = False, split: bool | None = None) -> torch.Tensor | None:
        """Write one pass into the step buffers and run the drafter over it: the output
        hidden states of its readout rows, in `readout` order, or None where it reads
        out none. Rows whose outputs nobody reads only write their K/V (`write_kv`,
        the same bits): the whole pass where it reads out nothing, and, `split` (by
        default: past `SPLIT_MIN_SKIPPED` such rows), the rows before each request's
        readout rows, which then run alone."""
        readout = draft_pass.readout
        rows = draft_pass.num_rows
        if split is None:
            split = rows - len(readout) >= SPLIT_MIN_SKIPPED
        block = draft_pass.readout_block() if split and len(readout) else None
        meta = self._write(draft_pass, res)
        if direct_hidden:
            self.hidden[:rows] = hidden_in
        else:
            features, src = self._with_cached(draft_pass, res, hidden_in)
            self.net.write_context_hidden(self.hidden[:rows], features, src)
        ids = self.buffers.input_ids.copy_to_device(rows)
        pos = self.buffers.positions.copy_to_device(rows)
        if len(readout) and block is None:
            out = self.net(ids, self.hidden[:rows], pos, self.kv_caches, meta, self.attn)
            if len(readout) == rows:
                return out
            return out[torch.as_tensor(readout, device=out.device)]
        self.net.write_kv(ids, self.hidden[:rows], pos, self.kv_caches, meta, self.attn)
        return None if block is None else self._run_readout(draft_pass, res, block)

    def _run_readout(self, draft_pass: DraftPass, res: StepResult,
                     block: ReadoutBlock) -> torch.Tensor:
        """The readout rows of a pass whose K/V are all written, run alone as `block`
        (theirs written again, the same bits). The step buffers are refilled only now,
        after the call that read them."""
        readout = draft_pass.readout
        hidden = self.hidden[torch.as_tensor(readout, device=self.hidden.device)]
        meta = self._fill(draft_pass.token_ids[readout], draft_pass.positions[readout],
                          draft_pass.req_index[readout], res.rows[block.reqs], block.per_req,
                          block.seq_lens, res)
        ids = self.buffers.input_ids.copy_to_device(len(readout))
        pos = self.buffers.positions.copy_to_device(len(readout))
        return self.net(ids, hidden, pos, self.kv_caches, meta, self.attn)

    def _with_cached(self, draft_pass: DraftPass, res: StepResult, features: torch.Tensor
                     ) -> tuple[torch.Tensor, np.ndarray]:
        """The features a pass reads and each row's source in them: this step's target
        rows, then the cached features of its catch-up rows (appended after them)."""
        cached = np.flatnonzero(draft_pass.cached)
        if not len(cached) or self.feature_cache is None:
            return features, draft_pass.hidden_src
        slots = self._slots(res.rows[draft_pass.req_index[cached]],
                            draft_pass.positions[cached])
        stored = self.feature_cache[torch.as_tensor(slots, device=features.device)]
        src = draft_pass.hidden_src.copy()
        src[cached] = len(features) + np.arange(len(cached))
        return torch.cat([features, stored.to(features.dtype)]), src

    def _write(self, draft_pass: DraftPass, res: StepResult) -> AttentionMetadata:
        """Fill the step buffers for one pass (requests with no rows are left out)."""
        active = np.flatnonzero(draft_pass.rows_per_req > 0)
        per_req = draft_pass.rows_per_req[active]
        return self._fill(draft_pass.token_ids, draft_pass.positions, draft_pass.req_index,
                          res.rows[active], per_req, draft_pass.starts[active] + per_req, res)

    def _fill(self, token_ids: np.ndarray, positions: np.ndarray, row_req: np.ndarray,
              state_rows: np.ndarray, per_req: np.ndarray, seq_lens: np.ndarray,
              res: StepResult) -> AttentionMetadata:
        """The step buffers and metadata of rows (each row's scheduled request
        `row_req`) of requests (their state rows, rows and sequence lengths), each
        request's rows the last of its sequence."""
        buffers, rows = self.buffers, len(positions)
        buffers.input_ids.np[:rows] = token_ids
        buffers.positions.np[:rows] = positions
        buffers.slot_mapping.np[:rows] = self._slots(res.rows[row_req], positions)
        num = len(state_rows)
        buffers.query_start_loc.np[0] = 0
        buffers.query_start_loc.np[1:num + 1] = np.cumsum(per_req)
        buffers.seq_lens.np[:num] = seq_lens
        buffers.block_table.np[:num] = self.states.block_table[state_rows]
        return AttentionMetadata(
            num_actual_tokens=rows, num_reqs=num,
            query_start_loc=buffers.query_start_loc.copy_to_device(num + 1),
            seq_lens=buffers.seq_lens.copy_to_device(num),
            block_table=buffers.block_table.copy_to_device(num),
            slot_mapping=buffers.slot_mapping.copy_to_device(rows),
            max_query_len=int(per_req.max()), max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=buffers.query_start_loc.np[:num + 1].tolist(),
            seq_lens_cpu=buffers.seq_lens.np[:num].tolist(),
        )
