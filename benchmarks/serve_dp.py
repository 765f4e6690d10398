"""Serving through HTTP against the engine's own capacity, and with data-parallel replicas.

Each series is `specbudget serve` in its own process on 127.0.0.1 at a free port, loaded
by `specbudget bench serve`'s client (engine/bench.py) from this process, with the same
concurrency sweep of streaming completions (greedy, `ignore_eos`, so every request
makes exactly max_tokens tokens):

- **one engine**: `specbudget serve` (the engine in the server's process, all cores);
- **Ray N=2**: `specbudget serve --data-parallel-size 2`, two replicas on Ray, the cores
  split between them.

And the **offline capacity** of the same engine settings: `LLM.generate` on the same
prompts and shapes with `max_num_seqs` = the concurrency, in this process with no
server. Served ÷ offline at each concurrency is the share of the engine's capacity the
HTTP front end leaves to clients. (Until this revision the client ran in the server's
process, and its one-engine figure measured mostly GIL contention with the client.)

On this 2-core machine the replicas share two cores, so N = 2 cannot double anything.
JSON and a PNG plot.

    python benchmarks/serve_dp.py [--quick] [--concurrency 1,4,16] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import engine_cli_args, serve_and_sweep  # noqa: E402
from engine import bench  # noqa: E402
from engine.bench_plot import plot_series  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODEL_NAME = "smollm2-135m"
SERIES = {"one engine": [], "Ray N=2": ["--data-parallel-size", "2"]}


def run_series(base: bench.LoadConfig, concurrencies: list[int],
               engine_args: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    series = {}
    for label, extra in SERIES.items():
        series[label] = serve_and_sweep(engine_cli_args(engine_args) + extra, MODEL_NAME,
                                        label, base, concurrencies)
    return series


def offline_capacity(base: bench.LoadConfig, concurrencies: list[int],
                     engine_args: dict[str, Any]) -> list[dict[str, Any]]:
    """Output tokens/s of `LLM.generate` on the sweep's prompts and shapes, at
    max_num_seqs = each concurrency: what the engine does with no server at all."""
    from engine.llm import LLM
    from scheduler import SamplingParams

    pool = bench.default_prompts(base.endpoint)
    prompts = [pool[i % len(pool)] for i in range(base.num_prompts)]
    params = SamplingParams(max_tokens=base.max_tokens, ignore_eos=True)
    runs = []
    for concurrency in concurrencies:
        llm = LLM(**{**engine_args, "max_num_seqs": concurrency})
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append({"concurrency": concurrency, "output_throughput": tokens / elapsed})
    return runs


def front_end_share(series: dict[str, list[dict[str, Any]]],
                    offline: list[dict[str, Any]]) -> dict[str, Any]:
    """Served ÷ offline output tok/s per concurrency (one engine), and N=2 ÷ one engine."""
    one, two = series["one engine"], series["Ray N=2"]
    return {
        "concurrency": [run["concurrency"] for run in one],
        "served_tok_s": [round(run["output_throughput"], 1) for run in one],
        "offline_tok_s": [round(run["output_throughput"], 1) for run in offline],
        "served_over_offline": [round(a["output_throughput"] / b["output_throughput"], 3)
                                for a, b in zip(one, offline, strict=True)],
        "n2_over_one_engine": [round(b["output_throughput"] / a["output_throughput"], 3)
                               for a, b in zip(one, two, strict=True)],
        "ttft_ms_p50": {label: [run["ttft_ms"]["p50"] for run in runs]
                        for label, runs in series.items()},
        "itl_ms_p50": {label: [run["itl_ms"]["p50"] for run in runs]
                       for label, runs in series.items()},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--concurrency", default=None, help="default 1,4,16 (quick: 1,2)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="per run (default 32; quick: 4)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="per request (default 32; quick: 8)")
    parser.add_argument("--out", default=None,
                        help="JSON (default benchmarks/results/serve_dp[_quick].json)")
    args = parser.parse_args(argv)
    quick = args.quick
    concurrencies = bench.parse_list(args.concurrency or ("1,2" if quick else "1,4,16"))
    base = bench.LoadConfig(num_prompts=args.num_prompts or (4 if quick else 32),
                            max_tokens=args.max_tokens or (8 if quick else 32),
                            ignore_eos=True)
    engine_args = {"max_num_batched_tokens": 256, "max_num_seqs": max(16, *concurrencies),
                   "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}
    start = time.perf_counter()
    series = run_series(base, concurrencies, engine_args)
    offline = offline_capacity(base, concurrencies, engine_args)
    out = Path(args.out or RESULTS / f"serve_dp{'_quick' if quick else ''}.json")
    report = {
        "benchmark": "serve_dp", "model": MODEL_NAME, "quick": quick,
        "concurrency": concurrencies, "num_prompts": base.num_prompts,
        "max_tokens": base.max_tokens, "cores": os.cpu_count(),
        "engine": engine_args, "offline": offline,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "front_end": front_end_share(series, offline),
        "wall_s": time.perf_counter() - start, "series": series,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot = out.with_suffix(".png")
    plot_series(series, str(plot), title=(
        f"serve_dp: {MODEL_NAME}, completions, {base.num_prompts} requests per run, "
        f"max_tokens {base.max_tokens}, greedy; {os.cpu_count()} cores"))
    print(json.dumps(report["front_end"], indent=2))
    print(f"wrote {out} and {plot} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
