"""What every benchmark script shares: the --out / --quick options and the JSON write."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

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
