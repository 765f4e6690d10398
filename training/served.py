"""The served figure of a trained head: what a user will see when serving with it.

The held-out instructions (the benchmarks' held-out workload) go through the engine
one at a time, greedy, at the engine's own dtype, each configuration stepped side by
side with speculation off (engine/stepwise.py; this machine's speed drifts by tens of
percent over seconds, so each ratio pairs steps made ~50 ms apart): first the new head
at fixed K (the acceptance per position: every request drafts all K), then, with that
acceptance recorded where an engine loading the head reads it, the new head under the
engine's default draft policy with K its most (the tok/s a user gets who only names
the method), and beside it the head drafting trees of `SERVED_TREE` (the tok/s a user
gets who asks for them: `draft_top_k`, runner/draft_tree.py). Every speculative
output must equal speculation off's: a head that changed an output would be a bug,
and the figure says so.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from engine.llm import LLM
from engine.stepwise import run_request_by_request, run_side_by_side
from runner.config import RunnerConfig
from runner.draft_gate import TRAINED_HEAD_MIN_CONFIDENCE
from runner.model_loader import load_model
from runner.models.llama import LlamaForCausalLM
from scheduler import SamplingParams
from spec_decode import SpeculativeConfig, get_method
from spec_decode.tree_shape import tree_nodes
from training.prompts import instructions

# The tree the served figure also drafts. [4, 2, 1] served each trained head fastest
# while a drafter ran its passes' padding (README "Drafted token trees"); run without
# it, a wider tree's first drafter pass costs no more, and [6, 3, 1] serves as fast
# with a longer mean length (by request beside off, one process each, eagle's cached
# head 2.044 at 1.553x against 2.017 at 1.556x, a freshly trained one 2.031 at 1.529x
# against 1.988 at 1.512x; parallel 1.878 at 1.465x against 1.818 at 1.447x; dflash
# 1.660 at 1.273x against 1.618 at 1.269x).
SERVED_TREE = (6, 3, 1)


def served_figures_apart(model_path: Path, dtype: str, head_dir: Path, method: str, k: int,
                         num_prompts: int = 24, max_tokens: int = 64) -> dict[str, Any]:
    """`served_figures` in a fresh interpreter of its own (spawned), the state a user's
    server is in. Served in the process that had just made the data and trained the
    head, speculation off ran 29.7 tok/s where a fresh process runs 37.7, and eagle's
    trees read 1.268x off where they read 1.503x (the same head, the same prompts,
    measured): that process's leftovers slow every engine, a tree's most, so its
    figure was not the one a user sees."""
    with ProcessPoolExecutor(max_workers=1,
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_served_in_child, str(model_path), dtype, str(head_dir), method,
                           k, num_prompts, max_tokens).result()


def _served_in_child(model_path: str, dtype: str, head_dir: str, method: str, k: int,
                     num_prompts: int, max_tokens: int) -> dict[str, Any]:
    model = load_model(Path(model_path), RunnerConfig(dtype=dtype).torch_dtype)
    return served_figures(model, Path(head_dir), method, k, num_prompts=num_prompts,
                          max_tokens=max_tokens)


def served_engine(model: LlamaForCausalLM, spec: dict[str, Any] | None,
                  max_num_seqs: int = 1) -> LLM:
    """An engine as the served figure runs one (`spec` None: speculation off), warmed up."""
    llm = LLM(loaded_model=model, speculative_config=spec, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=256, max_model_len=1024)
    llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    return llm


def _spec_counts(before: dict[str, Any], after: dict[str, Any]
                 ) -> tuple[list[int], list[int], int, int]:
    """Drafts made and accepted per position, drafts, and verifications a drafted
    tree's leaf won, between two metric reads."""
    def per_position(name: str) -> list[int]:
        was, now = before[name], after[name]
        return [(now[i] if i < len(now) else 0) - (was[i] if i < len(was) else 0)
                for i in range(max(len(now), 1))]

    return (per_position("num_draft_tokens_per_pos"),
            per_position("num_accepted_tokens_per_pos"),
            after["num_drafts"] - before["num_drafts"],
            after["num_leaf_hits"] - before["num_leaf_hits"])


def side_by_side(model: LlamaForCausalLM, specs: list[dict[str, Any] | None],
                 prompts: list[str], max_tokens: int, by_request: bool = False,
                 concurrency: int = 1) -> list[dict[str, Any]]:
    """One side-by-side run of each configuration (greedy, `concurrency` requests
    running at most), engines taking turns a step at a time (or, `by_request`, a
    request at a time: engine/stepwise.py): tok/s, outputs, and drafts made and
    accepted per position and verifications."""
    if by_request and concurrency > 1:
        raise ValueError("taking turns a request at a time runs one request at a time")
    engines: list[LLM] = []
    try:
        engines.extend(served_engine(model, spec, concurrency) for spec in specs)
        rendered = [engines[0].tokenizer.apply_chat_template([{"role": "user", "content": p}])
                    for p in prompts]
        befores = [llm.get_metrics()["spec_decode"] for llm in engines]
        run = run_request_by_request if by_request else run_side_by_side
        seconds, outs = run(engines, rendered,
                            SamplingParams(max_tokens=max_tokens, temperature=0.0))
        runs = []
        for llm, before, took, got in zip(engines, befores, seconds, outs, strict=True):
            drafted, accepted, drafts, leaf_hits = _spec_counts(
                before, llm.get_metrics()["spec_decode"])
            tokens = [list(o.outputs[0].token_ids) for o in got]
            runs.append({"tokens_per_s": sum(map(len, tokens)) / took, "outputs": tokens,
                         "drafted": drafted, "accepted": accepted, "drafts": drafts,
                         "leaf_hits": leaf_hits})
        return runs
    finally:  # closed whatever failed: three engines' caches are not left behind
        for llm in engines:
            llm.close()


def served_figures(model: LlamaForCausalLM, head_dir: Path, method: str, k: int,
                   num_prompts: int = 24, max_tokens: int = 64, rounds: int = 1
                   ) -> dict[str, Any]:
    """Acceptance per position and mean acceptance length at fixed K, and output tok/s
    against speculation off at concurrency 1 at fixed K and under the default draft
    policy, on `num_prompts` held-out instructions, `rounds` side-by-side runs
    (medians). The fixed runs come first, and their figures are recorded in the head's
    `metrics.json` before the default policy runs: an engine that loads the finished
    head starts its goodput policy from them (runner/eagle3.py `measured_acceptance`),
    and started from the held-out agreement instead (dflash's 0.36, 0.24, 0.17, 0.12
    taken as rates per reached draft, where served they are 0.45, 0.43, 0.41, 0.5) it
    ran 1.18x off where the same head with its record runs 1.45x (measured). One round
    of 24 prompts by default: acceptance is deterministic, so a second round of the
    same prompts adds timing only, where as many distinct prompts add both."""
    prompts = instructions("eval")[:num_prompts]
    spec = {"method": method, "model": str(head_dir), "num_speculative_tokens": k}
    default_policy = SpeculativeConfig.draft_policy
    # A chain method's acceptance is measured with every chain drawn to K (its
    # confidence gate off: runner/draft_gate.py), the head's own figure and the prior
    # its goodput policy reads; its speed also as the engine serves it, gate on.
    chained = get_method(method).sequential
    fixed = {**spec, "draft_policy": "fixed"}
    specs = [None, {**fixed, "min_draft_confidence": 0.0}, fixed] if chained else [None, fixed]
    off, on, *gated = (list(runs) for runs in zip(
        *(side_by_side(model, specs, prompts, max_tokens) for _ in range(rounds)),
        strict=True))
    figures = _acceptance(on, k, len(prompts), max_tokens, rounds)
    if gated:  # the goodput policy's prior of how far chains go at this gate
        figures["proposal_rates"] = proposal_rates(on, gated[0], k)
        figures["min_draft_confidence"] = TRAINED_HEAD_MIN_CONFIDENCE
    record_served(head_dir, figures)
    tree = {**fixed, "num_speculative_tokens": tree_nodes(SERVED_TREE, k),
            "draft_top_k": list(SERVED_TREE)}
    off_default, default, trees = (list(runs) for runs in zip(
        *(side_by_side(model, [None, {**spec, "draft_policy": default_policy}, tree],
                       prompts, max_tokens) for _ in range(rounds)), strict=True))
    offs = off + off_default
    served = gated[0] if gated else on
    return {
        **figures,
        "tokens_per_s_off": round(statistics.median(r["tokens_per_s"] for r in off), 2),
        # Fixed K as the engine serves it (a chain method: with its default gate).
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in served), 2),
        "speedup_vs_off": _speedup(off, served),
        **({"speedup_vs_off_every_chain_to_k": _speedup(off, on)} if gated else {}),
        # The same head under the engine's default policy, K its most.
        "default_policy": default_policy,
        "tokens_per_s_default_policy": round(statistics.median(
            r["tokens_per_s"] for r in default), 2),
        "speedup_vs_off_default_policy": _speedup(off_default, default),
        "tree": _tree_figures(tree, off_default, trees, k),
        "lossless": all(r["outputs"] == off[0]["outputs"]
                        for r in offs + on + served + default + trees),
    }


def _tree_figures(spec: dict[str, Any], off: list[dict[str, Any]],
                  runs: list[dict[str, Any]], depth: int) -> dict[str, Any]:
    """The head drafting SERVED_TREE's trees (fixed policy, `depth` deep), side by side
    with off."""
    return {"draft_top_k": spec["draft_top_k"], "k": spec["num_speculative_tokens"],
            **tree_acceptance(runs, depth), "speedup_vs_off": _speedup(off, runs)}


def tree_acceptance(runs: list[dict[str, Any]], depth: int) -> dict[str, Any]:
    """Drafted trees' acceptance over `runs`: mean acceptance length, how often a
    verification reached each depth (a tree accepts at most one token a depth, so the
    accepted count at list position d is its reach there; later positions are 0),
    verifications a leaf won, and verifications."""
    drafts = sum(r["drafts"] for r in runs)
    accepted = _per_position(runs, "accepted", depth)
    return {"mean_acceptance_length": round(1 + sum(accepted) / drafts, 3) if drafts else None,
            "reach": [round(a / drafts, 4) for a in accepted] if drafts else [],
            "leaf_hits": sum(r["leaf_hits"] for r in runs), "verifications": drafts}


def _speedup(off: list[dict[str, Any]], runs: list[dict[str, Any]]) -> float:
    """The median over rounds of each run's tok/s over the off run beside it."""
    return round(statistics.median(b["tokens_per_s"] / a["tokens_per_s"]
                                   for a, b in zip(off, runs, strict=True)), 3)


def proposal_rates(whole: list[dict[str, Any]], gated: list[dict[str, Any]], k: int
                   ) -> list[float]:
    """How often a gated chain allowed j drafts proposed its j-th, per position: the
    gated runs' drafts at j per first draft, over the same share where every chain
    was drawn to K (which counts the rule's own cuts near `max_tokens`)."""
    def share(runs: list[dict[str, Any]]) -> list[float]:
        made = _per_position(runs, "drafted", k)
        return [m / made[0] if made[0] else 0.0 for m in made]

    return [round(min(g / w, 1.0), 4) if w else 0.0
            for g, w in zip(share(gated), share(whole), strict=True)]


def _per_position(runs: list[dict[str, Any]], key: str, k: int) -> list[int]:
    """The runs' `key` counts (drafts made or accepted) summed per position 1..k."""
    return [sum(r[key][i] for r in runs if i < len(r[key])) for i in range(k)]


def _acceptance(on: list[dict[str, Any]], k: int, prompts: int, max_tokens: int,
                rounds: int) -> dict[str, Any]:
    """The fixed-K runs' acceptance figures, in the form `metrics.json` keeps."""
    drafted, accepted = _per_position(on, "drafted", k), _per_position(on, "accepted", k)
    drafts = sum(r["drafts"] for r in on)
    return {
        "k": k, "prompts": prompts, "max_tokens": max_tokens, "rounds": rounds,
        # vLLM's figure: of the drafts made at position i, the share accepted.
        "acceptance_per_position": [round(a / d, 4) if d else None
                                    for a, d in zip(accepted, drafted, strict=True)],
        "mean_acceptance_length": round(1 + sum(accepted) / drafts, 3) if drafts else None,
        "draft_tokens": sum(drafted),
    }


def record_served(head_dir: Path, figures: dict[str, Any]) -> None:
    """Put `figures` under "served" in the head's `metrics.json`, keeping the rest."""
    path = head_dir / "metrics.json"
    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError):
        metrics = {}
    if not isinstance(metrics, dict):
        metrics = {}
    path.write_text(json.dumps({**metrics, "served": figures}, indent=2) + "\n")
