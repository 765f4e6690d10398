"""What the HTTP front end costs: offline capacity against served throughput, with the
engine on a thread of the server's process (the old layout, `--engine-in-process`),
in its own process (the default), and as two data-parallel replicas on Ray
(`--data-parallel-size 2`, the cores split between them; `--layouts` picks).

For each concurrency c the same requests (the completion prompts of `engine/bench.py`,
greedy, `ignore_eos`, so every run makes exactly the same tokens) go through:
- **offline**: `LLM.generate` with `max_num_seqs=c` in this process, no HTTP;
- **in-process**, **process** and **ray-2**: `specbudget serve` in its own process,
  the streaming client (`engine/bench.py`) in this one, c requests in flight.
Served ÷ offline is the share of the engine's capacity a user gets through HTTP.
TTFT and ITL are the client's p50/p99. Layouts alternate within each repeat and the
medians over repeats are reported (timings on a shared machine are noisy).

    python benchmarks/serve_overhead.py [--quick] [--repeats 3] [--layouts in-process,process]
                                        [--out JSON]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    bench_parser,
    engine_cli_args,
    out_path,
    server_process,
    write_report,
)
from engine import bench  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "serve_overhead.json"
MODEL_NAME = "smollm2-135m"
LAYOUTS = {"in-process": ["--engine-in-process"], "process": [],
           "ray-2": ["--data-parallel-size", "2"]}
DEFAULT_LAYOUTS = "in-process,process"


def engine_args(max_concurrency: int) -> dict[str, Any]:
    return {"max_num_batched_tokens": 512, "max_num_seqs": max_concurrency,
            "max_model_len": 512, "kv_cache_memory_bytes": 256 << 20}


def offline_run(prompts: list[str], cfg: bench.LoadConfig, args: dict[str, Any]
                ) -> dict[str, Any]:
    """Output tok/s of `LLM.generate` on the same requests, c at a time."""
    from engine.llm import LLM
    from scheduler import SamplingParams

    llm = LLM(**{**args, "max_num_seqs": cfg.concurrency})
    try:
        params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        duration = time.perf_counter() - start
    finally:
        llm.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"concurrency": cfg.concurrency, "duration_s": duration,
            "total_output_tokens": tokens, "output_throughput": tokens / duration}


def summary(offline: list[dict[str, Any]], served: dict[str, list[list[dict[str, Any]]]],
            concurrencies: list[int]) -> list[dict[str, Any]]:
    """Per concurrency: medians over repeats of each series, and served ÷ offline as the
    median of each repeat's own ratio (offline and served run back to back within a
    repeat, so a drift of the machine between repeats falls on both)."""
    rows = []
    for i, c in enumerate(concurrencies):
        caps = [r["output_throughput"] for r in offline[i::len(concurrencies)]]
        cap = statistics.median(caps)
        row: dict[str, Any] = {"concurrency": c, "offline_tok_s": round(cap, 1)}
        for layout, repeats in served.items():
            runs = [rep[i] for rep in repeats]
            tok_s = statistics.median(r["output_throughput"] for r in runs)
            paired = statistics.median(r["output_throughput"] / o for r, o in zip(runs, caps))
            row[layout] = {
                "tok_s": round(tok_s, 1), "served_over_offline": round(paired, 3),
                "ratio_of_medians": round(tok_s / cap, 3),
                **{f"{m}_{p}_ms": round(statistics.median(r[f"{m}_ms"][p] for r in runs), 2)
                   for m in ("ttft", "itl") for p in ("p50", "p99")},
                "failed": sum(r["failed"] for r in runs)}
        rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], layouts: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("tok_s", "output tok/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
              ("itl_p50_ms", "ITL p50 (ms)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.6))
    xs = [r["concurrency"] for r in rows]
    for ax, (key, label) in zip(axes, panels, strict=True):
        if key == "tok_s":
            ax.plot(xs, [r["offline_tok_s"] for r in rows], marker="o", label="offline")
        for layout in layouts:
            ax.plot(xs, [r[layout][key] for r in rows], marker="o", label=f"served, {layout}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--concurrency", default=None, help="default 1,16,64 (quick: 1,4)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 32 (quick: 8)")
    parser.add_argument("--requests-per-slot", type=int, default=None,
                        help="requests per run = this x concurrency, at least 8 "
                        "(default 2; quick: 1)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                        help=f"comma-separated, of {', '.join(LAYOUTS)} (default "
                        f"{DEFAULT_LAYOUTS})")
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown or not layouts:
        parser.error(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    quick = args.quick
    concurrencies = bench.parse_list(args.concurrency or ("1,4" if quick else "1,16,64"))
    max_tokens = args.max_tokens or (8 if quick else 32)
    per_slot = args.requests_per_slot or (1 if quick else 2)
    repeats = args.repeats or (1 if quick else 3)
    eargs = {**engine_args(max(concurrencies)), "dtype": args.dtype}
    pool = list(bench.COMPLETION_PROMPTS)
    started = time.perf_counter()
    offline: list[dict[str, Any]] = []
    served: dict[str, list[list[dict[str, Any]]]] = {layout: [] for layout in layouts}
    for repeat in range(repeats):
        order = layouts if repeat % 2 == 0 else layouts[::-1]
        for c in concurrencies:
            n = max(8, per_slot * c)
            cfg = bench.LoadConfig(num_prompts=n, max_tokens=max_tokens, concurrency=c,
                                   ignore_eos=True)
            run = offline_run([pool[i % len(pool)] for i in range(n)], cfg, eargs)
            print(f"repeat {repeat} offline c={c}: {run['output_throughput']:.1f} tok/s",
                  flush=True)
            offline.append(run)
        for layout in order:
            base = bench.LoadConfig(max_tokens=max_tokens, ignore_eos=True)
            served[layout].append(_sweep(layout, base, concurrencies, per_slot, pool, eargs))
    rows = summary(offline, served, concurrencies)
    report = {"benchmark": "serve_overhead", "quick": quick, "model": MODEL_NAME,
              "concurrency": concurrencies, "max_tokens": max_tokens,
              "requests_per_slot": per_slot, "repeats": repeats, "layouts": layouts,
              "engine": eargs,
              "summary": rows, "offline": offline, "served": served,
              "wall_s": round(time.perf_counter() - started, 1)}
    out = out_path(args, DEFAULT_OUT)
    write_report(out, report)
    plot(rows, layouts, out.with_suffix(".png"), f"served vs offline: {MODEL_NAME}, dtype "
         f"{args.dtype}, {max_tokens} tokens per request, client in its own process")
    for row in rows:
        print(f"c={row['concurrency']}: offline {row['offline_tok_s']} tok/s; " + "; ".join(
            f"{layout} {row[layout]['tok_s']} ({row[layout]['served_over_offline']}x), "
            f"TTFT p50 {row[layout]['ttft_p50_ms']} ms, ITL p50 {row[layout]['itl_p50_ms']} ms"
            for layout in layouts))
    print(f"wrote {out} ({report['wall_s']:.0f} s)")
    return report


def _sweep(layout: str, base: bench.LoadConfig, concurrencies: list[int], per_slot: int,
           pool: list[str], args: dict[str, Any]) -> list[dict[str, Any]]:
    """One server of `layout`, a run per concurrency with per_slot x c requests."""
    runs = []
    with server_process(engine_cli_args(args) + LAYOUTS[layout]) as url:
        for c in concurrencies:
            cfg = bench.LoadConfig(num_prompts=max(8, per_slot * c),
                                   max_tokens=base.max_tokens, concurrency=c, ignore_eos=True)
            runs += bench.run_sweep(url, MODEL_NAME, cfg, concurrencies=[c], prompts=pool,
                                    warmup=2, log=lambda line: print(f"  {layout}: {line}",
                                                                     flush=True))
    return runs


if __name__ == "__main__":
    main()
