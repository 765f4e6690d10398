"""Serving with data-parallel replicas: one engine, one replica on Ray, two replicas.

Three servers in turn, each in this process on 127.0.0.1 at a free port, each loaded
by `specbudget bench serve`'s client (engine/bench.py) with the same concurrency sweep
of streaming completions (greedy, `ignore_eos`, so every request makes exactly
max_tokens tokens):

- **one engine**: `AsyncEngine` in this process (what `specbudget serve` runs for N = 1),
  all cores;
- **Ray N=1**: `DataParallelEngine` with one replica (all cores): the same engine behind
  the data-parallel front end and one Ray hop. Its TTFT and ITL over one engine's, at
  concurrency 1, are the front end's added latency per request and per streamed token;
- **Ray N=2**: two replicas, the cores split between them.

On this 2-core machine the replicas share two cores, so N = 2 cannot double anything;
the point is what it gives and what the front end costs. JSON and a PNG plot.

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

from benchmarks.common import serve_and_sweep  # noqa: E402
from engine import bench  # noqa: E402
from engine.bench_plot import plot_series  # noqa: E402
from engine.config import EngineConfig  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODEL_NAME = "smollm2-135m"
SERIES = ("one engine", "Ray N=1", "Ray N=2")


def _engine(label: str, config: EngineConfig) -> Any:
    cores = os.cpu_count() or 1
    if label == "one engine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine(config, log_interval_s=1e9)
    from engine.data_parallel import DataParallelEngine

    size = int(label.rsplit("=", 1)[1])
    engine = DataParallelEngine(config, size, model_name=MODEL_NAME,
                                num_threads=max(1, cores // size))
    engine.wait_ready(every=True)
    return engine


def run_series(base: bench.LoadConfig, concurrencies: list[int],
               config: EngineConfig) -> dict[str, list[dict[str, Any]]]:
    return {label: serve_and_sweep(_engine(label, config), MODEL_NAME, label, base,
                                   concurrencies) for label in SERIES}


def front_end_cost(series: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Ray N=1 minus one engine at the lowest concurrency: added ms per request (TTFT
    p50) and per streamed token (ITL p50); then N=2 over one engine in throughput."""
    one, ray1, ray2 = (series[label][0] for label in SERIES)
    return {
        "concurrency": one["concurrency"],
        "added_ttft_ms_p50": round(ray1["ttft_ms"]["p50"] - one["ttft_ms"]["p50"], 2),
        "added_itl_ms_p50": round(ray1["itl_ms"]["p50"] - one["itl_ms"]["p50"], 3),
        "ttft_ms_p50": {"one engine": one["ttft_ms"]["p50"], "Ray N=1": ray1["ttft_ms"]["p50"]},
        "itl_ms_p50": {"one engine": one["itl_ms"]["p50"], "Ray N=1": ray1["itl_ms"]["p50"]},
        "throughput_ratio_n2_over_one_engine": [
            round(b["output_throughput"] / a["output_throughput"], 3)
            for a, b in zip(series["one engine"], series["Ray N=2"], strict=True)],
        "ray_n2_ttft_ms_p50": ray2["ttft_ms"]["p50"],
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
    config = EngineConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512,
                          kv_cache_memory_bytes=64 << 20)
    start = time.perf_counter()
    series = run_series(base, concurrencies, config)
    out = Path(args.out or RESULTS / f"serve_dp{'_quick' if quick else ''}.json")
    report = {
        "benchmark": "serve_dp", "model": MODEL_NAME, "quick": quick,
        "concurrency": concurrencies, "num_prompts": base.num_prompts,
        "max_tokens": base.max_tokens, "cores": os.cpu_count(),
        "engine": {"max_num_batched_tokens": 256, "max_num_seqs": 16,
                   "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20},
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "front_end": front_end_cost(series),
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
