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


def engine_measures(dtype: str, quantization: str | None, max_tokens: int, batch: int,
                    quick: bool) -> dict[str, Any]:
    """Batch-1 greedy chat decode; ngram K = 4 against speculation off on input-grounded
    prompts (outputs compared token for token); and `batch` chat requests at once.
    `quantization` None is not passed on (revisions before it did not take it)."""
    from benchmarks.spec_decode import GROUNDED
    from engine import LLM
    from scheduler import SamplingParams

    extra = {} if quantization is None else {"quantization": quantization}
    llm = LLM(dtype=dtype, max_num_seqs=max(batch, 1), kv_cache_memory_bytes=1 << 30, **extra)
    params = SamplingParams(max_tokens=max_tokens)

    def timed(engine: Any, prompt: str) -> tuple[float, list[int]]:
        begin = time.perf_counter()
        out = engine.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)
        return time.perf_counter() - begin, list(out[0].outputs[0].token_ids)

    def warm(engine: Any) -> None:
        engine.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=2),
                    use_tqdm=False)

    warm(llm)
    result: dict[str, Any] = {"dtype": dtype, "quantization": quantization}
    decodes = [timed(llm, p) for p in (CHAT[:2] if quick else CHAT)]
    result["decode_tok_s"] = sum(len(ids) for _, ids in decodes) / sum(t for t, _ in decodes)
    spec = LLM(dtype=dtype, speculative_config={"method": "ngram", "num_speculative_tokens": 4},
               loaded_model=llm.engine.runner.model, **extra)
    warm(spec)
    # Off and ngram alternate prompt by prompt, over rounds: drift on a shared machine
    # then hits both alike (one block of each swung the ratio from 0.65x to 1.28x).
    grounded = GROUNDED[:1] if quick else GROUNDED
    times = {"off": 0.0, "ngram": 0.0}
    tokens = {"off": 0, "ngram": 0}
    equal = True
    for _ in range(1 if quick else 3):
        for prompt in grounded:
            t_off, off = timed(llm, prompt)
            t_on, on = timed(spec, prompt)
            times["off"] += t_off
            times["ngram"] += t_on
            tokens["off"] += len(off)
            tokens["ngram"] += len(on)
            equal &= on == off
    result["grounded_off_tok_s"] = tokens["off"] / times["off"]
    result["grounded_ngram_tok_s"] = tokens["ngram"] / times["ngram"]
    result["grounded_ngram_speedup"] = result["grounded_ngram_tok_s"] / result[
        "grounded_off_tok_s"]
    result["grounded_ngram_equal_to_off"] = equal
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
