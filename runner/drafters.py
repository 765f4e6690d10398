"""Every speculative method drafts through one `Drafter`, made by `make_drafter` from
the kind its class names (`SpecMethod.drafter`).

The kind is a string, not a class, because spec_decode sits below the runner and may
not import it; this table turns it into a drafter. A method whose kind is missing here
is refused by name when the runner is built, never silently given no drafter.

  kind      drafter                              methods
  "lookup"  TokenDrafter over the method's       ngram, suffix
            TokenProposer (no forward pass)
  "head"    ModelDrafter over an EAGLE-3 head    eagle, mtp, parallel, dflash
  "lm"      ModelDrafter over a draft LM         draft_model, pard
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from runner.attention import AttentionBackend
from runner.buffers import StepBuffers
from runner.draft_gate import gate_priced, min_draft_confidence
from runner.drafter import RANDOM_HEAD, DraftNet, ModelDrafter, make_draft_lm, make_head
from runner.models.llama import LlamaForCausalLM
from runner.request_states import RequestStates
from spec_decode import SpecMethod, SpeculativeConfig
from spec_decode.measured import MeasuredAcceptance
from spec_decode.passes import StepResult, StepRows
from spec_decode.proposer import TokenProposer


class Drafter(Protocol):
    """What the runner asks of a method's drafter, every method alike.

    `add_request` / `remove_request` as a request starts (or resumes) and leaves;
    `propose` once per step, after verification, for every request that samples with
    k >= 1; the KV and buffer sizes once, when the runner sizes its memory.
    """

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose inputs the drafter reads (the runner captures them)."""
        ...

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the drafter's own buffers, beyond the runner's step buffers."""
        ...

    @property
    def measured_acceptance(self) -> MeasuredAcceptance | None:
        """Acceptance per draft position as measured for this drafter (a trained
        head's, runner/eagle3.py `measured_acceptance`), or None."""
        ...

    def kv_bytes_per_block(self) -> int:
        """KV bytes the drafter's own cache needs per block of the shared block table."""
        ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def add_request(self, req_id: str, token_ids: list[int]) -> None: ...

    def remove_request(self, req_id: str, finished: bool) -> None: ...

    def propose(self, res: StepResult, target_features: torch.Tensor, req_ids: list[str],
                planned: StepRows) -> dict[str, list[int]]:
        """At most k drafts per request id, for every request that samples with k >= 1."""
        ...

    def shadow(self, res: StepResult, req_ids: list[str],
               wanted: list[str]) -> dict[str, int]:
        """The first draft each `wanted` request (parked: it samples with k = 0) would
        propose, where proposing runs no pass (`SpecMethod.shadows`); else nothing."""
        ...


@dataclass(frozen=True)
class DraftContext:
    """What a drafter factory may draw on: the target and the runner's parts."""

    target: LlamaForCausalLM
    buffers: StepBuffers  # the runner's persistent step buffers (sized by B)
    states: RequestStates
    block_size: int
    attn: AttentionBackend
    max_num_batched_tokens: int
    target_path: Path | None = None  # trained heads are cached under its name


class TokenDrafter:
    """Drafts by token lookup through the method's `TokenProposer`: no network, no KV
    cache, no buffer of its own."""

    aux_layer_ids: tuple[int, ...] = ()
    buffer_bytes = 0
    measured_acceptance: MeasuredAcceptance | None = None  # learnt online from nothing

    def __init__(self, proposer: TokenProposer, states: RequestStates) -> None:
        self.proposer, self.states = proposer, states

    def kv_bytes_per_block(self) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """No KV cache."""

    def add_request(self, req_id: str, token_ids: list[int]) -> None:
        self.proposer.add_request(req_id, np.asarray(token_ids, dtype=np.int64))

    def remove_request(self, req_id: str, finished: bool) -> None:
        self.proposer.remove_request(req_id, finished)

    def propose(self, res: StepResult, target_features: torch.Tensor, req_ids: list[str],
                planned: StepRows) -> dict[str, list[int]]:
        states, drafts = self.states, {}
        for i in np.flatnonzero(res.num_draft_tokens).tolist():
            row, k = res.rows[i], int(res.num_draft_tokens[i])
            known = states.token_ids[row, :states.num_tokens[row]]
            drafts[req_ids[i]] = self.proposer.propose(req_ids[i], known, k)[:k]
        return drafts

    def shadow(self, res: StepResult, req_ids: list[str],
               wanted: list[str]) -> dict[str, int]:
        states, shadows, want = self.states, {}, set(wanted)
        for i in np.flatnonzero(res.samples & (res.num_draft_tokens == 0)).tolist():
            if req_ids[i] not in want:
                continue
            row = res.rows[i]
            known = states.token_ids[row, :states.num_tokens[row]]
            got = self.proposer.propose(req_ids[i], known, 1)
            if got:
                shadows[req_ids[i]] = int(got[0])
        return shadows


DrafterFactory = Callable[[SpeculativeConfig, DraftContext], Drafter]


def _lookup(spec: SpeculativeConfig, ctx: DraftContext) -> Drafter:
    return TokenDrafter(spec.spec_method.make_proposer(spec), ctx.states)


def _model(spec: SpeculativeConfig, net: DraftNet, ctx: DraftContext, trained: bool
           ) -> Drafter:
    tree = not spec.tree_shape.is_chain
    threshold = min_draft_confidence(spec.options, spec.spec_method.sequential, trained,
                                     tree=tree)
    priced = gate_priced(spec, trained, tree)
    return ModelDrafter(spec, net, ctx.target, ctx.buffers, ctx.states, ctx.block_size,
                        ctx.attn, ctx.max_num_batched_tokens, threshold, priced)


def _head(spec: SpeculativeConfig, ctx: DraftContext) -> Drafter:
    return _model(spec, make_head(spec, ctx.target, ctx.target_path), ctx,
                  trained=spec.model != RANDOM_HEAD)


def _lm(spec: SpeculativeConfig, ctx: DraftContext) -> Drafter:
    # A draft LM's threshold is not measured here: chains drawn to k unless asked.
    return _model(spec, make_draft_lm(spec, ctx.target), ctx, trained=False)


# Drafter kind (`SpecMethod.drafter`) -> the factory that builds it. A new kind is one
# entry here; a new method of an existing kind needs none.
DRAFTER_FACTORIES: dict[str, DrafterFactory] = {"lookup": _lookup, "head": _head, "lm": _lm}


def drafter_factory(method: SpecMethod) -> DrafterFactory:
    """The factory for `method`'s drafter kind; ValueError naming both if there is none."""
    try:
        return DRAFTER_FACTORIES[method.drafter]
    except KeyError:
        raise ValueError(f"speculative method {method.name!r} names drafter kind "
                         f"{method.drafter!r}, which has no factory in runner/drafters.py "
                         f"(known kinds: {', '.join(DRAFTER_FACTORIES)})") from None


def make_drafter(spec: SpeculativeConfig, ctx: DraftContext) -> Drafter:
    """The drafter of `spec`'s method, built by its kind's factory."""
    return drafter_factory(spec.spec_method)(spec, ctx)
