"""Serving benchmark: streaming completions over HTTP, speculation off vs on.

With `--self-contained` (the default when no `--base-url` is given) it runs
`specbudget serve` twice in turn, each in its own process on 127.0.0.1 at a free port
(the client stays in this one): speculation off, then ngram (prompt lookup) K=3.
Each server gets the same concurrency sweep of streaming /v1/chat/completions over
short editing tasks (`engine.bench.EDIT_PROMPTS`: fix a typo, add type hints, ...; greedy, so both
servers produce the very same tokens, and speculation can only change the time). The
client (`engine/bench.py`) records TTFT, TPOT, ITL and e2e per request, throughput
per run, and acceptance from the server's /metrics spec-decode counters. Writes JSON
and a PNG plot. `--endpoint completions` uses raw completion prompts instead.

The client and the server share this machine's cores (not a process); compare the two
series within one run.

    python benchmarks/serve_bench.py [--quick] [--out JSON] [--plot PNG]
    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000   # a running server
"""

from __future__ import annotations

import argparse
import json
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
SERIES = {"spec off": None, "ngram K=3": {"method": "ngram", "num_speculative_tokens": 3}}
MODEL_NAME = "smollm2-135m"


def run_self_contained(base: bench.LoadConfig, concurrencies: list[int],
                       engine_args: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each SERIES entry served in turn by `specbudget serve` in its own process; the
    sweep against each from this one."""
    series = {}
    for label, spec in SERIES.items():
        options = {**engine_args, **({"speculative_config": spec} if spec else {})}
        series[label] = serve_and_sweep(engine_cli_args(options), MODEL_NAME, label, base,
                                        concurrencies)
    return series


def compare(series: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Speculation on ÷ off per concurrency: output throughput and median TPOT."""
    if set(series) != set(SERIES):
        return []
    off, on = (series[label] for label in SERIES)
    lines = []
    for a, b in zip(off, on, strict=True):
        tpot = (b["tpot_ms"]["p50"] / a["tpot_ms"]["p50"]
                if a["tpot_ms"]["p50"] and b["tpot_ms"]["p50"] else float("nan"))
        lines.append(f"concurrency {a['concurrency']}: ngram/off output tok/s "
                     f"{b['output_throughput'] / a['output_throughput']:.2f}x, "
                     f"TPOT p50 {tpot:.2f}x; output tokens {a['total_output_tokens']} / "
                     f"{b['total_output_tokens']}")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--self-contained", action="store_true",
                        help="serve the default model here, spec off then ngram K=3 "
                        "(the default when no --base-url is given)")
    parser.add_argument("--base-url", default=None, help="benchmark a running server instead")
    parser.add_argument("--model", default=None)
    parser.add_argument("--quick", action="store_true", help="a ~30 s smoke run")
    parser.add_argument("--concurrency", default=None, help="default 1,4,8 (quick: 1,4)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="per run (default 32; quick: 4)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="per request (default 32; quick: 12)")
    parser.add_argument("--endpoint", default="chat", choices=("chat", "completions"))
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every request makes exactly max_tokens tokens")
    parser.add_argument("--out", default=None,
                        help="JSON (default benchmarks/results/serve_bench[_quick].json)")
    parser.add_argument("--plot", default=None, help="PNG (default: the JSON path, .png)")
    args = parser.parse_args(argv)
    quick = args.quick
    concurrencies = bench.parse_list(args.concurrency or ("1,4" if quick else "1,4,8"))
    base = bench.LoadConfig(num_prompts=args.num_prompts or (4 if quick else 32),
                            max_tokens=args.max_tokens or (12 if quick else 32),
                            endpoint=args.endpoint, ignore_eos=args.ignore_eos)
    engine_args = {"max_num_batched_tokens": 256, "max_num_seqs": 16, "max_model_len": 512,
                   "kv_cache_memory_bytes": 64 << 20}
    start = time.perf_counter()
    if args.base_url and not args.self_contained:
        model = args.model or bench.first_served_model(args.base_url)
        series = {model: bench.run_sweep(args.base_url, model, base,
                                         concurrencies=concurrencies)}
        where = args.base_url
    else:
        series = run_self_contained(base, concurrencies, engine_args)
        where = "specbudget serve in its own process, 127.0.0.1"
    out = Path(args.out or RESULTS / f"serve_bench{'_quick' if quick else ''}.json")
    plot = Path(args.plot or out.with_suffix(".png"))
    report = {
        "benchmark": "serve_bench", "server": where, "model": args.model or MODEL_NAME,
        "quick": quick, "concurrency": concurrencies, "num_prompts": base.num_prompts,
        "max_tokens": base.max_tokens, "endpoint": base.endpoint,
        "ignore_eos": base.ignore_eos, "engine": engine_args,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "wall_s": time.perf_counter() - start, "series": series,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot_series(series, str(plot), title=(
        f"serve_bench: {report['model']}, {base.endpoint}, {base.num_prompts} requests per "
        f"run, max_tokens {base.max_tokens}, greedy; {where}"))
    for line in compare(series):
        print(line)
    print(f"wrote {out} and {plot} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
