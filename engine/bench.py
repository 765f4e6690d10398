"""Serving benchmark client: streaming completions against an OpenAI-compatible server.

Measures what vLLM's `benchmark_serving` measures, the same way: per request the time
to first token (TTFT), the gaps between streamed chunks (ITL; with speculative decoding
one chunk may carry several tokens), time per output token after the first
(TPOT = (e2e − TTFT) / (output tokens − 1)) and end-to-end latency; per run the
request and output-token throughput. Load is either a fixed number of requests in
flight (`concurrency`) or Poisson arrivals at `request_rate` req/s. Acceptance comes
from the server's own `/metrics` spec-decode counters, read before and after each run
(`specbudget:` or `vllm:` prefix), so the client needs no tokenizer.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

# Short completion prompts, half of them with text the answer is likely to repeat, so
# prompt lookup (ngram) has something to find.
COMPLETION_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "Copy the list exactly: apple, banana, cherry, date, elderberry, fig, grape. "
    "Copy: apple, banana, cherry,",
    "def area(width, height):\n    return width * height\n\ndef area(width, height):\n",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24",
    "The capital of France is",
    "Once upon a time, a curious robot",
    "Three tips for staying healthy are",
    "The best way to learn a new language is",
)
# Chat editing tasks: the answer rewrites the input, where prompt lookup shines
# (the default model accepts about 45 % of ngram K=3 drafts on these).
EDIT_PROMPTS = (
    "Fix the typo in: 'The quick brown fox jumsp over the lazy dog.'",
    "Rewrite this Python function with type hints:\n\n"
    "def area(width, height):\n    return width * height\n",
    "Add a docstring to this function:\n\n"
    "def greet(name):\n    return 'Hello, ' + name + '!'\n",
    "Repeat this sentence exactly: The early bird catches the worm, but the second "
    "mouse gets the cheese.",
    "Convert this list to a Python list literal: apple, banana, cherry, date, elderberry",
    "Rename the variable x to count in this code:\n\n"
    "x = 0\nfor item in items:\n    x += 1\nprint(x)\n",
    "Correct the grammar: 'She don't like apples and he don't like oranges.'",
    'Format this JSON with one key per line: {"name": "Ada", "age": 36, "city": "London"}',
)
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def default_prompts(endpoint: str) -> tuple[str, ...]:
    return EDIT_PROMPTS if endpoint == "chat" else COMPLETION_PROMPTS


SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens")
PER_POS_COUNTER = "spec_decode_num_accepted_tokens_per_pos"


@dataclass
class RequestResult:
    """One streamed request, timed on the client (seconds)."""

    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LoadConfig:
    """One run: `concurrency` requests in flight, or Poisson arrivals at `request_rate`
    (inf = all at once), or both (arrivals capped at `concurrency` in flight).
    `endpoint` "completions" sends each prompt as is, "chat" as one user message."""

    num_prompts: int = 16
    max_tokens: int = 32
    concurrency: int | None = None
    request_rate: float = math.inf
    temperature: float = 0.0
    ignore_eos: bool = False
    endpoint: str = "completions"
    seed: int = 0
    # A --request-rate run: `concurrency` is then only a cap, not the load.
    rate_run: bool = False
    progress: bool = False  # a tqdm bar per run, as vLLM's benchmark shows


def _request_body(model: str, prompt: str, cfg: LoadConfig) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
        "ignore_eos": cfg.ignore_eos, "stream": True,
        "stream_options": {"include_usage": True}}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def stream_completion(client: httpx.AsyncClient, base_url: str, model: str,
                            prompt: str, cfg: LoadConfig) -> RequestResult:
    """One streamed request; a chunk counts as an arrival when it carries text or the
    finish reason (not chat's opening role-only chunk, not the usage chunk)."""
    start = time.perf_counter()
    arrivals: list[float] = []
    usage: dict[str, int] | None = None
    finish_reason = None
    try:
        async with client.stream("POST", base_url + ENDPOINTS[cfg.endpoint],
                                 json=_request_body(model, prompt, cfg)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {resp.status_code}: {body[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"])[:200])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if _chunk_text(choice) or choice.get("finish_reason"):
                        arrivals.append(time.perf_counter())
                    finish_reason = choice.get("finish_reason") or finish_reason
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return RequestResult(False, error=repr(err))
    return _timed_result(start, arrivals, usage, finish_reason, cfg)


def _timed_result(start: float, arrivals: list[float], usage: dict[str, int] | None,
                  finish_reason: str | None, cfg: LoadConfig) -> RequestResult:
    if not arrivals:
        return RequestResult(False, error="stream carried no completion chunk")
    if usage and usage.get("completion_tokens") is not None:
        output_tokens = int(usage["completion_tokens"])
    elif finish_reason == "length":
        output_tokens = cfg.max_tokens
    else:  # no usage: one token per chunk, a lower bound
        output_tokens = len(arrivals)
    return RequestResult(True, ttft=arrivals[0] - start, e2e=arrivals[-1] - start,
                         itl=[b - a for a, b in itertools.pairwise(arrivals)],
                         output_tokens=output_tokens,
                         prompt_tokens=int((usage or {}).get("prompt_tokens", 0)))


async def run_load(base_url: str, model: str, prompts: Iterable[str],
                   cfg: LoadConfig) -> tuple[list[RequestResult], float]:
    """Send `cfg.num_prompts` requests (prompts cycled); results and wall seconds."""
    pool = list(prompts)
    rng = random.Random(cfg.seed)
    limit = asyncio.Semaphore(cfg.concurrency or cfg.num_prompts)

    async def one(client: httpx.AsyncClient, i: int) -> RequestResult:
        async with limit:
            return await stream_completion(client, base_url, model, pool[i % len(pool)], cfg)

    limits = httpx.Limits(max_connections=max(cfg.concurrency or cfg.num_prompts, 1))
    bar = tqdm(total=cfg.num_prompts, desc="requests", disable=not cfg.progress,
               leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for i in range(cfg.num_prompts):
            task = asyncio.create_task(one(client, i))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
            if math.isfinite(cfg.request_rate) and i + 1 < cfg.num_prompts:
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = list(await asyncio.gather(*tasks))
    bar.close()
    return results, time.perf_counter() - start


# ---- the server's spec-decode counters -------------------------------------------------

def scrape_spec_decode(base_url: str, model: str | None = None) -> dict[str, Any] | None:
    """Cumulative spec-decode counters from GET /metrics; None if the server has none."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=30.0).text
    except httpx.HTTPError:
        return None
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total") or ":" not in sample.name:
                continue
            if model is not None and sample.labels.get("model_name", model) != model:
                continue
            name = sample.name.split(":", 1)[1].removesuffix("_total")
            if name in SPEC_COUNTERS:
                totals[name] = totals.get(name, 0.0) + sample.value
            elif name == PER_POS_COUNTER:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
    if not totals:
        return None
    return {**totals, "per_pos": [per_pos[p] for p in sorted(per_pos)]}


def spec_decode_delta(before: dict[str, Any] | None,
                      after: dict[str, Any] | None) -> dict[str, Any] | None:
    """Acceptance over one run, from the counters before and after it."""
    if before is None or after is None:
        return None
    diff = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in SPEC_COUNTERS}
    drafts, drafted, accepted = (diff[name] for name in SPEC_COUNTERS)
    old = before["per_pos"] + [0.0] * (len(after["per_pos"]) - len(before["per_pos"]))
    return {
        "num_drafts": int(drafts), "num_draft_tokens": int(drafted),
        "num_accepted_tokens": int(accepted),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "accepted_per_pos": [int(a - b) for a, b in zip(after["per_pos"], old)],
    }


# ---- summaries -----------------------------------------------------------------------

def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(values) * 1000.0
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)),
            "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float, cfg: LoadConfig,
              spec_decode: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run's figures (latencies in ms), as written to the JSON report."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    return {
        # A rate run's load is its arrivals; its concurrency is only a cap (or none).
        "concurrency": None if cfg.rate_run else cfg.concurrency,
        "max_concurrency": cfg.concurrency if cfg.rate_run else None,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "num_prompts": cfg.num_prompts, "max_tokens": cfg.max_tokens,
        "endpoint": cfg.endpoint, "ignore_eos": cfg.ignore_eos,
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "ttft_ms": _percentiles([r.ttft for r in done]),
        "tpot_ms": _percentiles([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": _percentiles([gap for r in done for gap in r.itl]),
        "e2e_ms": _percentiles([r.e2e for r in done]),
        "spec_decode": spec_decode,
    }


def run_one(base_url: str, model: str, cfg: LoadConfig,
            prompts: Iterable[str]) -> dict[str, Any]:
    """One run with the server's spec-decode counters read around it."""
    before = scrape_spec_decode(base_url, model)
    results, duration = asyncio.run(run_load(base_url, model, prompts, cfg))
    after = scrape_spec_decode(base_url, model)
    return summarize(results, duration, cfg, spec_decode_delta(before, after))


def run_sweep(base_url: str, model: str, base: LoadConfig, *,
              concurrencies: Iterable[int] = (), request_rates: Iterable[float] = (),
              prompts: Iterable[str] | None = None, warmup: int = 1,
              log: Any = print) -> list[dict[str, Any]]:
    """A run per concurrency, then per request rate, after `warmup` unmeasured requests
    (prompts: the endpoint's default set unless given)."""
    pool = list(prompts if prompts is not None else default_prompts(base.endpoint))
    base_url = base_url.rstrip("/")
    if warmup:
        warm = _with(base, num_prompts=warmup, max_tokens=min(base.max_tokens, 4),
                     concurrency=None, request_rate=math.inf, progress=False)
        asyncio.run(run_load(base_url, model, pool, warm))
    configs = [_with(base, concurrency=c) for c in concurrencies]
    configs += [_with(base, request_rate=r, rate_run=True) for r in request_rates]
    runs = []
    for cfg in configs:
        run = run_one(base_url, model, cfg, pool)
        log(format_run(run))
        runs.append(run)
    return runs


def _with(base: LoadConfig, **changes: Any) -> LoadConfig:
    return LoadConfig(**{**base.__dict__, **changes})


def format_run(run: dict[str, Any]) -> str:
    """One line per run: load, throughput, median latencies, acceptance."""
    cap = run.get("max_concurrency")
    load = (f"concurrency {run['concurrency']}" if run["concurrency"] is not None
            else f"rate {run['request_rate']} req/s"
            + (f" (at most {cap} in flight)" if cap is not None else ""))
    spec = run["spec_decode"]
    accept = ("" if not spec or spec["acceptance_rate"] is None
              else f", acceptance {spec['acceptance_rate']:.2f} "
                   f"(mean length {spec['mean_acceptance_length']:.2f})")

    def ms(key: str) -> str:
        value = run[key]["p50"]
        return "-" if value is None else f"{value:.0f}"

    return (f"{load}: {run['completed']}/{run['num_prompts']} ok in {run['duration_s']:.1f} s, "
            f"{run['request_throughput']:.2f} req/s, {run['output_throughput']:.1f} tok/s; "
            f"p50 TTFT {ms('ttft_ms')} ms, TPOT {ms('tpot_ms')} ms, ITL {ms('itl_ms')} ms, "
            f"e2e {ms('e2e_ms')} ms{accept}")


def parse_list(text: str, kind: type = int, name: str = "value") -> list[Any]:
    """'1,4,16' -> [1, 4, 16]; 'inf' is accepted for rates. Every item must be > 0:
    a concurrency of 0 would send nothing and wait forever, a rate of 0 likewise."""
    try:
        items = [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list of numbers, got {text!r}"
                         ) from None
    if not items or any(not item > 0 for item in items):
        raise ValueError(f"{name} values must be > 0, got {text!r}")
    return items


# ---- the server ------------------------------------------------------------------------

def first_served_model(base_url: str) -> str:
    """The first model id of GET /v1/models."""
    models = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=30.0).json()["data"]
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])
