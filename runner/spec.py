"""The runner's speculative-decoding side: verify this step's drafts, propose the next.

Model-free methods (ngram, suffix) propose by token lookup and build no pass; model
methods run their drafter passes through `ModelDrafter` in the runner's buffers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runner.attention import AttentionBackend
from runner.buffers import StepBuffers
from runner.drafter import ModelDrafter
from runner.models.llama import LlamaForCausalLM
from runner.request_states import RequestStates
from spec_decode import SpeculativeConfig
from spec_decode.passes import StepResult, StepRows
from spec_decode.proposer import TokenProposer
from spec_decode.rejection_sampler import RejectionSampler
from spec_decode.sampling import SamplingMetadata


def make_rejection_sampler(device: torch.device | str) -> RejectionSampler:
    """Triton kernels on CUDA, the torch reference elsewhere. Here, in the runner that
    calls it, not beside the base class the Triton sampler derives from (spec_decode
    stays free of import cycles)."""
    if torch.device(device).type == "cuda":
        from spec_decode.triton_rejection import TritonRejectionSampler

        return TritonRejectionSampler()
    return RejectionSampler()


class SpecDecoder:
    """Verification (rejection sampling) and drafting for one method."""

    def __init__(self, spec: SpeculativeConfig, target: LlamaForCausalLM,
                 buffers: StepBuffers, states: RequestStates, block_size: int,
                 attn: AttentionBackend, max_num_batched_tokens: int,
                 target_path: Path | None = None) -> None:
        """`target_path`: the target's checkpoint dir, under whose name trained heads
        are cached."""
        self.config = spec
        self.states = states
        self.proposer: TokenProposer | None = None
        self.drafter: ModelDrafter | None = None
        if spec.spec_method.drafter is None:
            self.proposer = spec.spec_method.make_proposer(spec)
        else:
            self.drafter = ModelDrafter(spec, target, buffers, states, block_size, attn,
                                        max_num_batched_tokens, target_path)
        self.rejection = make_rejection_sampler(target.lm_head.weight.device)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose inputs the drafter reads (an EAGLE-3 head's three)."""
        return self.drafter.aux_layer_ids if self.drafter else ()

    def kv_bytes_per_block(self) -> int:
        return self.drafter.kv_bytes_per_block() if self.drafter else 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.drafter:
            self.drafter.initialize_kv_cache(num_blocks)

    @property
    def buffer_bytes(self) -> int:
        return self.drafter.buffer_bytes if self.drafter else 0

    def add_request(self, req_id: str, token_ids: list[int]) -> None:
        if self.proposer:
            self.proposer.add_request(req_id, np.asarray(token_ids, dtype=np.int64))

    def remove_request(self, req_id: str, finished: bool) -> None:
        if self.proposer:
            self.proposer.remove_request(req_id, finished)

    def verify(self, sampling_ids: list[str], spec: dict[str, list[int]],
               logits: torch.Tensor, meta: SamplingMetadata) -> list[list[int]]:
        """Accepted drafts plus one recovered / bonus token, per sampling request.

        `logits` holds each sampling request's 1 + s rows in order (input prep).
        """
        drafts = [spec.get(rid, []) for rid in sampling_ids]
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64,
                            device=logits.device)
        out = self.rejection.forward(flat, [len(d) for d in drafts], None, logits, meta)
        return [[t for t in row if t >= 0] for row in out.tolist()]

    def propose(self, res: StepResult, target_features: torch.Tensor, req_ids: list[str],
                planned: StepRows) -> dict[str, list[int]]:
        """Next drafts for every request that samples with k >= 1."""
        drafting = np.flatnonzero(res.num_draft_tokens)
        if self.proposer is not None:
            states = self.states
            return {req_ids[i]: self.proposer.propose(
                        req_ids[i], states.token_ids[res.rows[i], :states.num_tokens[res.rows[i]]],
                        int(res.num_draft_tokens[i]))[:int(res.num_draft_tokens[i])]
                    for i in drafting.tolist()}
        assert self.drafter is not None
        by_index = self.drafter.propose(res, target_features, planned)
        return {req_ids[i]: by_index[i][:int(res.num_draft_tokens[i])] for i in drafting.tolist()}
