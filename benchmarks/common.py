"""What every benchmark script shares: the --out / --quick options and the JSON write."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


def served_head_args(parser: argparse.ArgumentParser) -> None:
    """--method, --prompts, --max-tokens and --head: a trained head served on held-out
    instructions (`served_head`)."""
    parser.add_argument("--method", default="eagle")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--head", default=None,
                        help="head dir, or 'random' (default: the trained one)")


def served_head(args: argparse.Namespace) -> tuple[Any, str, list[str]]:
    """The default model in the engine's dtype, the head `--head` names (the trained
    one by default) and the held-out instructions (2 prompts of 12 tokens `--quick`)."""
    from runner.config import RunnerConfig
    from runner.eagle3 import trained_head_dir
    from runner.model_loader import load_model
    from runner.model_prep import resolve_model
    from training.prompts import instructions

    if args.quick:
        args.prompts, args.max_tokens = 2, 12
    path = resolve_model(None)
    model = load_model(path, RunnerConfig().torch_dtype)
    head = args.head or str(trained_head_dir(path, args.method))
    return model, head, instructions("eval")[:args.prompts]


def out_path(args: argparse.Namespace, default_out: Path) -> Path:
    if args.out is not None:
        return Path(args.out)
    return default_out.with_stem(default_out.stem + "_quick") if args.quick else default_out


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def engine_cli_args(engine_args: dict[str, Any]) -> list[str]:
    """EngineConfig fields as `specbudget serve` options: {"max_num_seqs": 16} ->
    ["--max-num-seqs", "16"] (kv_cache_memory_bytes -> --kv-cache-memory, JSON for the
    speculative config)."""
    args = []
    for name, value in engine_args.items():
        if name == "speculative_config":
            args += ["--speculative-config", json.dumps(value)]
            continue
        flag = {"kv_cache_memory_bytes": "--kv-cache-memory"}.get(
            name, "--" + name.replace("_", "-"))
        args += [flag, str(value)]
    return args


@contextmanager
def server_process(serve_args: list[str], start_timeout: float = 600) -> Iterator[str]:
    """`specbudget serve` in its own process on a free port until the block ends; yields
    its base URL. The benchmark's client then runs in this process, never in the
    server's (sharing its GIL, it measured 28.8 tok/s where the server does 168)."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "specbudget", "serve", "--port", str(port),
                             "--log-level", "warning", *serve_args], cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"specbudget serve exited with {proc.returncode}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("specbudget serve did not become healthy")
            time.sleep(0.3)
        yield base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def serve_and_sweep(serve_args: list[str], model_name: str, label: str, base: LoadConfig,
                    concurrencies: list[int]) -> list[dict[str, Any]]:
    """`specbudget serve` with these options in its own process, the bench-serve sweep
    against it from this one, then the server stopped (the serving benchmarks' series)."""
    from engine import bench

    with server_process(serve_args) as base_url:
        print(f"== {label}: {base_url}", flush=True)
        return bench.run_sweep(base_url, model_name, base, concurrencies=concurrencies,
                               log=lambda line: print("  " + line, flush=True))
