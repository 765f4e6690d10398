"""Decode speed a user sees through the offline API, for benchmarks/cpu_forward.py.

Standalone on purpose: cpu_forward runs it against older revisions of the project (in
a git worktree) too, so it imports only what the API has always had, and only inside
the function.
"""

from __future__ import annotations

import time
from typing import Any

CHAT = [
    "Explain what a hash table is and when to use one.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give three tips for a job interview, with one sentence on each.",
    "Describe how a bicycle gear system works.",
]


def engine_measures(dtype: str, max_tokens: int, batch: int, quick: bool) -> dict[str, Any]:
    """Batch-1 greedy chat decode; ngram K = 4 against speculation off on input-grounded
    prompts (outputs compared token for token); and `batch` chat requests at once."""
    from benchmarks.spec_decode import GROUNDED
    from engine import LLM
    from scheduler import SamplingParams

    llm = LLM(dtype=dtype, max_num_seqs=max(batch, 1), kv_cache_memory_bytes=1 << 30)
    params = SamplingParams(max_tokens=max_tokens)

    def chat_tok_s(engine: Any, prompts: list[str]) -> tuple[float, list[list[int]]]:
        engine.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=2),
                    use_tqdm=False)
        outputs, elapsed = [], 0.0
        for prompt in prompts:
            begin = time.perf_counter()
            out = engine.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)
            elapsed += time.perf_counter() - begin
            outputs.append(list(out[0].outputs[0].token_ids))
        return sum(map(len, outputs)) / elapsed, outputs

    grounded = GROUNDED[:1] if quick else GROUNDED
    result: dict[str, Any] = {"dtype": dtype}
    result["decode_tok_s"], _ = chat_tok_s(llm, CHAT[:2] if quick else CHAT)
    result["grounded_off_tok_s"], off = chat_tok_s(llm, grounded)
    spec = LLM(dtype=dtype, speculative_config={"method": "ngram", "num_speculative_tokens": 4},
               loaded_model=llm.engine.runner.model)
    result["grounded_ngram_tok_s"], on = chat_tok_s(spec, grounded)
    result["grounded_ngram_speedup"] = result["grounded_ngram_tok_s"] / result[
        "grounded_off_tok_s"]
    result["grounded_ngram_equal_to_off"] = on == off
    result["ngram_mean_acceptance_length"] = spec.get_metrics()["spec_decode"].get(
        "mean_acceptance_length")
    prompts = [[{"role": "user", "content": f"{CHAT[i % len(CHAT)]} ({i})"}]
               for i in range(batch)]
    begin = time.perf_counter()
    outs = llm.chat(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    use_tqdm=False)
    result[f"batch{batch}_tok_s"] = (sum(len(o.outputs[0].token_ids) for o in outs)
                                     / (time.perf_counter() - begin))
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
