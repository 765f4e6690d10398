"""Speculative decoding configuration (no torch: the scheduler imports this)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from spec_decode.methods import SpecMethod, get_method, method_names
from spec_decode.tree_shape import TreeShape

METHODS = method_names()  # the methods shipped here; the registry may hold more
DRAFT_POLICIES = ("goodput", "fixed", "fit")
# The top-level keys of a speculative_config dict; the rest are the method's options.
_FIELDS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min",
           "prompt_lookup_max", "draft_policy", "park_drafter")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which drafter runs and how many drafts each request may propose per step.

    `num_speculative_tokens` is K, the ceiling on drafts per request per step; the
    scheduler cuts each request's k below it near `max_model_len` / `max_tokens`
    (DESIGN.md §2). `model` names the drafter checkpoint for model-based methods,
    `prompt_lookup_min/max` bound the n-gram sizes for `ngram`, and `options` carries
    method-specific settings the proposers read (the scheduler never does).

    `draft_policy="goodput"` (the default) caps each sampling request's k, 0
    included, where the scheduler expects the most output tokens per second from the
    step (scheduler/goodput.py: acceptance and step-time estimates it learns online).
    `"fixed"` gives every sampling request the rule's k; a request whose k does not
    fit the step's remaining budget takes a chunk that stops short of sampling, or
    waits. `"fit"` (adaptive) lets it propose fewer drafts instead, down to 0, and
    `SchedulerOutput.adapted_draft_tokens` reports each cut.

    `park_drafter` (on by default): under a method whose drafter keeps its own KV (a
    head, a draft LM), a request that samples with k = 0 skips the drafter's passes and
    catches up when it drafts again (`SpecMethod.parks`), so a step where nobody drafts
    costs what speculation off costs. Off: the drafter follows every chunk (what a
    rule that does not charge the drafter's passes needs: benchmarks' vLLM rules).

    `options["min_draft_confidence"]` (chain methods: eagle, mtp, draft_model): a
    request stops drafting once the product of its drafts' probabilities falls below
    it, short of its k (runner/draft_gate.py; a trained head's default 0.25, else 0).
    Not given, a trained head's chains under the goodput policy go on only while their
    next draft is learnt to gain what the policy prices a draft at this step
    (runner/draft_calibration.py), the default threshold where it prices none.

    `options["draft_top_k"]` (model methods; default 1): T > 1 drafts a tree, the
    chain of greedy drafts plus, at each depth, the next T - 1 candidates as leaves
    (runner/draft_tree.py; a list gives a width per depth, spec_decode/tree_shape.py).
    A request's drafts are then listed depth by depth, the chain's first ([a1, b1, a2,
    b2, ...] for T = 2), so K counts every node, as vLLM's tree does, and any prefix of
    the list is a tree: the scheduler's budget rule, cuts and charges hold unchanged,
    and a leaf that matches the target's token after a rejected draft wins one more
    token from its own row. The drafter's passes follow the tree's depth
    (`SpecMethod.drafting_trees`), and the goodput policy chooses and learns a depth,
    charging the nodes to it (scheduler/budget.py `TreeDepthRule`).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_policy: str = "goodput"
    park_drafter: bool = True
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"SpeculativeConfig.{name} must be an integer, got "
                                 f"{value!r}")
        if not isinstance(self.park_drafter, bool):
            raise ValueError(f"SpeculativeConfig.park_drafter must be true or false, got "
                             f"{self.park_drafter!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"SpeculativeConfig.model must be a string, got {self.model!r}")
        if not isinstance(self.method, str) or self.method not in method_names():
            raise ValueError(
                f"SpeculativeConfig.method={self.method!r} is not supported; "
                f"choose one of {', '.join(method_names())}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                "SpeculativeConfig.num_speculative_tokens must be >= 1 "
                f"(got {self.num_speculative_tokens}); pass speculative_config=None to "
                "turn speculation off"
            )
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(
                f"SpeculativeConfig.draft_policy={self.draft_policy!r} is not supported; "
                f"choose one of {', '.join(DRAFT_POLICIES)}"
            )
        _check_confidence(self.options)
        if "draft_top_k" in get_method(self.method).option_names:  # else: an unknown key
            _check_top_k(self.options)
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "SpeculativeConfig needs 1 <= prompt_lookup_min <= prompt_lookup_max "
                f"(got {self.prompt_lookup_min}, {self.prompt_lookup_max})"
            )

    @property
    def spec_method(self) -> SpecMethod:
        """The method's cost table, pass recipes and proposer (spec_decode/methods/),
        sized for its trees where it drafts them (`draft_top_k`)."""
        return get_method(self.method).drafting_trees(self.tree_shape)

    @property
    def tree_shape(self) -> TreeShape:
        """The drafts' tree (see the class docstring): a chain unless `draft_top_k` says
        otherwise, and for every method that does not draft trees."""
        widths = self.options.get("draft_top_k", 1)
        if "draft_top_k" not in get_method(self.method).option_names:
            widths = 1
        return tree_shape(widths, self.num_speculative_tokens)

    @property
    def parks(self) -> bool:
        """Whether a sampling request with k = 0 is parked (see the class docstring)."""
        return self.park_drafter and self.spec_method.parks

    @classmethod
    def from_dict(cls, spec: dict[str, Any] | None) -> SpeculativeConfig | None:
        """Build from a vLLM-style `speculative_config` dict; None means off."""
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict or None, got {spec!r:.80}")
        if "method" not in spec or "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens' "
                             f"(got keys {sorted(map(str, spec))})")
        kwargs = {key: value for key, value in spec.items() if key in _FIELDS}
        options = {key: value for key, value in spec.items() if key not in _FIELDS}
        config = cls(**kwargs, options=options)
        allowed = config.spec_method.option_names
        unknown = sorted(str(key) for key in options if key not in allowed)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown} for method "
                             f"{config.method!r}; known: {sorted(_FIELDS) + list(allowed)}")
        return config


def _check_confidence(options: dict[str, Any]) -> None:
    """`min_draft_confidence` (a chain method's option, runner/draft_gate.py): a
    probability, where given."""
    value = options.get("min_draft_confidence")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError("speculative_config.min_draft_confidence must be a number in "
                         f"[0, 1] (0: every chain drafts its k), got {value!r}")


MAX_DRAFT_TOP_K = 8
MAX_TREE_DEPTHS = 16


@functools.cache
def _shape(widths: tuple[int, ...], max_entries: int) -> TreeShape:
    return TreeShape(widths, max_entries)


def tree_shape(widths: int | list[int] | tuple[int, ...], max_entries: int) -> TreeShape:
    """The TreeShape `draft_top_k` names (one per config: they are built once)."""
    return _shape(tuple(widths) if isinstance(widths, list | tuple) else (widths,),
                  max_entries)


def _check_top_k(options: dict[str, Any]) -> None:
    """`draft_top_k`: an integer in [1, MAX_DRAFT_TOP_K], or a list of them, one per
    depth from the first (the last for every deeper one)."""
    value = options.get("draft_top_k", 1)
    widths = value if isinstance(value, list) and 0 < len(value) <= MAX_TREE_DEPTHS else [
        value]
    if any(isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_DRAFT_TOP_K
           for w in widths):
        raise ValueError(f"speculative_config.draft_top_k must be an integer in "
                         f"[1, {MAX_DRAFT_TOP_K}] (1: a chain), or a list of 1 to "
                         f"{MAX_TREE_DEPTHS} of them (one per depth, the last for every "
                         f"deeper one), got {value!r}")


def min_decode_rows(config: SpeculativeConfig) -> dict[str, int]:
    """Rows of each pass for one decoding request verifying and proposing all K drafts.

    `max_num_batched_tokens` below the largest of these cannot serve even one request
    at full speculation, so the scheduler refuses it at start.
    """
    k = config.num_speculative_tokens
    method = config.spec_method
    rows = {"target": 1 + k}
    rows.update(zip(method.pass_names, method.rows(1 + k, k)))
    return rows
