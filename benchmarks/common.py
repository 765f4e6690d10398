"""What every benchmark script shares: the --out / --quick options and the JSON write."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.async_engine import ServingEngine
    from engine.bench import LoadConfig

ROOT = Path(__file__).resolve().parents[1]


def bench_parser(doc: str | None, default_out: Path) -> argparse.ArgumentParser:
    """A parser with --out and --quick; `--quick` defaults to `*_quick.json`, so a test
    never overwrites the committed full run."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON output path (default {default_out.relative_to(ROOT)}; "
                             "--quick: *_quick.json)")
    parser.add_argument("--quick", action="store_true", help="a few seconds, for tests")
    return parser


def out_path(args: argparse.Namespace, default_out: Path) -> Path:
    if args.out is not None:
        return Path(args.out)
    return default_out.with_stem(default_out.stem + "_quick") if args.quick else default_out


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def serve_and_sweep(engine: ServingEngine, model_name: str, label: str, base: LoadConfig,
                    concurrencies: list[int]) -> list[dict[str, Any]]:
    """Serve `engine` in this process, run the bench-serve sweep against it, then shut
    the engine down (the serving benchmarks' one series)."""
    from engine import bench
    from engine.local_server import serve_in_thread

    try:
        with serve_in_thread(engine, model_name) as server:
            print(f"== {label}: {server.base_url}", flush=True)
            return bench.run_sweep(server.base_url, model_name, base,
                                   concurrencies=concurrencies,
                                   log=lambda line: print("  " + line, flush=True))
    finally:
        engine.shutdown()
