"""vLLM's two earlier drafter-budget rules, as ThrottleRules the Scheduler can run.

Both charge S, the most rows one request can ever add to a drafter pass beyond its n
target rows, instead of the rows it really adds this step (DESIGN.md §1):

- `StaticReservationRule` (vLLM PR #34898): the target pass starts at
  B - S * max_num_seqs and a request is charged its n target rows only; drafter
  passes are never charged.
- `FlatChargeRule` (vLLM PR #51725): one budget B, and every scheduled request is
  charged n + S whether or not it drafts this step.

DFlash's S is K + 1: its separate query pass is lumped with the target (vLLM #52922).

Each plan keeps the drafter passes' real rows, so `SchedulerOutput.num_drafter_tokens`
still equals what the SimulatedRunner builds and its invariant check runs unchanged;
those passes just get a budget that never binds. Drafts proposed per request (k) are
ours (cut near max_model_len / max_tokens), which only favours the vLLM rules.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler.budget import ChunkPlan, ThrottleRule
from spec_decode import SpeculativeConfig

# Budget of the drafter passes these rules never charge: large enough never to bind.
UNCHARGED = 1 << 40


# S per method, as vLLM reserves it: the most rows a request can add beyond its n
# target rows. eagle, mtp, ngram and suffix are never wider than the target pass.
_VLLM_S = {
    "dflash": lambda k: k + 1,
    "pard": lambda k: k,
    "parallel": lambda k: k - 1,
    "draft_model": lambda k: 1,
    "eagle": lambda k: 0,
    "mtp": lambda k: 0,
    "ngram": lambda k: 0,
    "suffix": lambda k: 0,
}


def per_request_reservation(method: str, k: int) -> int:
    """S for `method` at K = k; a method this table does not know is refused (a new
    method gets its vLLM reservation written here, never a silent 0)."""
    if method not in _VLLM_S:
        raise ValueError(f"no vLLM reservation S is known for method {method!r}; add it "
                         f"to benchmarks/vllm_rules.py (known: {sorted(_VLLM_S)})")
    return int(_VLLM_S[method](k))


def vllm_spec(spec: SpeculativeConfig) -> SpeculativeConfig:
    """`spec` with the drafter following every chunk, as vLLM's does: the rules below
    never park a request (a parked request's catch-up rows would widen a drafter
    pass they do not charge), and the runner must build what they charge."""
    return replace(spec, park_drafter=False)


class _ReservingRule(ThrottleRule):
    """Shared setup: our cost table and k rule, plus vLLM's per-method constant S."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        # vLLM's drafter follows every chunk (run them with `vllm_spec`).
        super().__init__(spec.spec_method, spec.num_speculative_tokens, max_model_len,
                         parks=False)
        self.reservation = per_request_reservation(spec.method, spec.num_speculative_tokens)

    def target_budget(self, max_num_batched_tokens: int) -> int:
        return max_num_batched_tokens

    def initial_budget(self, max_num_batched_tokens: int) -> list[int]:
        drafters = [UNCHARGED] * (self.num_passes - 1)
        return [self.target_budget(max_num_batched_tokens), *drafters]


class StaticReservationRule(_ReservingRule):
    """B - S * max_num_seqs for the target rows; the drafter is never charged."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int, max_num_seqs: int) -> None:
        super().__init__(spec, max_model_len)
        self.max_num_seqs = max_num_seqs

    def target_budget(self, max_num_batched_tokens: int) -> int:
        return max_num_batched_tokens - self.reservation * self.max_num_seqs

    def cannot_start(self, max_num_batched_tokens: int) -> str | None:
        """Why this rule cannot serve even one decoding request, or None."""
        target = self.target_budget(max_num_batched_tokens)
        need = 1 + self.max_k
        if target >= need:
            return None
        return (f"B - S*max_num_seqs = {max_num_batched_tokens} - {self.reservation}*"
                f"{self.max_num_seqs} = {target} < {need} (one decode: 1 + K)")


class FlatChargeRule(_ReservingRule):
    """n + S on every scheduled request, against B, drafting or not.

    The charge sits in the target pass's row, so `pass_rows["target"]` reports what
    was charged; the real target tokens are `sum(num_scheduled_tokens)`. plan_chunk
    checks every chunk's rows, prefill chunks that do not sample included, so a chunk
    shrinks by S rather than overshoot B (the benchmark still counts any overshoot).
    """

    def plan(self, n: int, num_spec: int, k: int, behind: int = 0,
             samples: bool = True) -> ChunkPlan:
        plan = super().plan(n, num_spec, k, behind, samples)
        return replace(plan, rows=(plan.rows[0] + self.reservation, *plan.rows[1:]))
