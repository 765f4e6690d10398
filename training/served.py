"""The served figure of a trained head: what a user will see when serving with it.

The held-out instructions (the benchmarks' held-out workload) go through the engine
one at a time, greedy, at the engine's own dtype, with speculation off and with the
new head at fixed K, in alternation (this machine's speed drifts, so each ratio pairs
runs made side by side). Every speculative output must equal speculation off's: a
head that changed an output would be a bug, and the figure says so.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from engine.llm import LLM
from runner.models.llama import LlamaForCausalLM
from scheduler import SamplingParams
from training.prompts import instructions


def _run(model: LlamaForCausalLM, spec: dict[str, Any] | None, chats: list, max_tokens: int
         ) -> dict[str, Any]:
    llm = LLM(loaded_model=model, speculative_config=spec, max_num_seqs=1,
              max_num_batched_tokens=256, max_model_len=1024)
    llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    before = llm.get_metrics()["spec_decode"]
    start = time.perf_counter()
    outs = llm.chat(chats, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                    use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.get_metrics()["spec_decode"]
    llm.close()

    def per_position(name: str) -> list[int]:
        was, now = before[name], after[name]
        return [(now[i] if i < len(now) else 0) - (was[i] if i < len(was) else 0)
                for i in range(max(len(now), 1))]

    drafted, accepted = (per_position("num_draft_tokens_per_pos"),
                         per_position("num_accepted_tokens_per_pos"))
    drafts = after["num_drafts"] - before["num_drafts"]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"tokens_per_s": sum(map(len, tokens)) / seconds, "outputs": tokens,
            "drafted": drafted, "accepted": accepted, "drafts": drafts}


def served_figures(model: LlamaForCausalLM, head_dir: Path, method: str, k: int,
                   num_prompts: int = 12, max_tokens: int = 64, rounds: int = 2
                   ) -> dict[str, Any]:
    """Acceptance per position, mean acceptance length and output
    tok/s against speculation off at concurrency 1, on `num_prompts` held-out
    instructions, `rounds` alternating pairs of runs (medians)."""
    chats = [[{"role": "user", "content": p}] for p in instructions("eval")[:num_prompts]]
    spec = {"method": method, "model": str(head_dir), "num_speculative_tokens": k,
            "draft_policy": "fixed"}
    off, on = [], []
    for _ in range(rounds):
        off.append(_run(model, None, chats, max_tokens))
        on.append(_run(model, spec, chats, max_tokens))
    drafted = [sum(r["drafted"][i] for r in on if i < len(r["drafted"])) for i in range(k)]
    accepted = [sum(r["accepted"][i] for r in on if i < len(r["accepted"])) for i in range(k)]
    drafts = sum(r["drafts"] for r in on)
    ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(off, on, strict=True)]
    return {
        "k": k, "prompts": len(chats), "max_tokens": max_tokens, "rounds": rounds,
        # vLLM's figure: of the drafts made at position i, the share accepted.
        "acceptance_per_position": [round(a / d, 4) if d else None
                                    for a, d in zip(accepted, drafted, strict=True)],
        "mean_acceptance_length": round(1 + sum(accepted) / drafts, 3) if drafts else None,
        "draft_tokens": sum(drafted),
        "tokens_per_s_off": round(statistics.median(r["tokens_per_s"] for r in off), 2),
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in on), 2),
        "speedup_vs_off": round(statistics.median(ratios), 3),
        "lossless": all(r["outputs"] == off[0]["outputs"] for r in off + on),
    }
