"""The runner's speculative-decoding side: verify this step's drafts, propose the next.

Every method drafts through the one `Drafter` its kind names (runner/drafters.py):
token lookup (ngram, suffix) builds no pass; model methods run their drafter passes
in the runner's buffers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from runner.attention import AttentionBackend
from runner.buffers import StepBuffers
from runner.drafters import DraftContext, Drafter, make_drafter
from runner.models.llama import LlamaForCausalLM
from runner.request_states import RequestStates
from spec_decode import SpeculativeConfig
from spec_decode.measured import MeasuredAcceptance
from spec_decode.passes import StepResult, StepRows
from spec_decode.rejection_sampler import RejectionSampler, greedy_walk
from spec_decode.sampling import SamplingMetadata, greedy_ids


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
        self.drafter: Drafter = make_drafter(spec, DraftContext(
            target, buffers, states, block_size, attn, max_num_batched_tokens, target_path))
        self.rejection = make_rejection_sampler(target.lm_head.weight.device)
        # An all-greedy step verified on the host (`greedy_walk`); False sends it
        # through the sampler, as benchmarks/greedy_walk.py compares.
        self.host_greedy_walk = True

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose inputs the drafter reads (an EAGLE-3 head's three)."""
        return self.drafter.aux_layer_ids

    @property
    def measured_acceptance(self) -> MeasuredAcceptance | None:
        """The drafter's acceptance per position as measured in training, if known."""
        return self.drafter.measured_acceptance

    def kv_bytes_per_block(self) -> int:
        return self.drafter.kv_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.drafter.initialize_kv_cache(num_blocks)

    @property
    def buffer_bytes(self) -> int:
        return self.drafter.buffer_bytes

    def add_request(self, req_id: str, token_ids: list[int]) -> None:
        self.drafter.add_request(req_id, token_ids)

    def remove_request(self, req_id: str, finished: bool) -> None:
        self.drafter.remove_request(req_id, finished)

    def verify(self, sampling_ids: list[str], spec: dict[str, list[int]],
               logits: torch.Tensor, meta: SamplingMetadata) -> list[list[int]]:
        """Accepted drafts plus one recovered / bonus token, per sampling request.

        `logits` holds each sampling request's 1 + s rows in order (input prep).
        """
        drafts = [spec.get(rid, []) for rid in sampling_ids]
        if meta.all_greedy and self.host_greedy_walk:
            return greedy_walk(drafts, greedy_ids(logits).tolist())
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64,
                            device=logits.device)
        out = self.rejection.forward(flat, [len(d) for d in drafts], None, logits, meta)
        return [[t for t in row if t >= 0] for row in out.tolist()]

    def propose(self, res: StepResult, target_features: torch.Tensor, req_ids: list[str],
                planned: StepRows) -> dict[str, list[int]]:
        """Next drafts for every request that samples with k >= 1."""
        return self.drafter.propose(res, target_features, req_ids, planned)

    def shadow(self, res: StepResult, req_ids: list[str],
               wanted: list[str]) -> dict[str, int]:
        """The first draft each parked request of `wanted` would propose
        (`SchedulerOutput.shadow_req_ids`), never verified."""
        return self.drafter.shadow(res, req_ids, wanted) if wanted else {}
