"""The GGUF-block linear kernel (runner/models/gemv_blocks.c) of this checkout against
the same file at another revision, in one process: each build runs every layer shape of
the default model (Q4_1 projections, the Q8_0 LM head) at several row counts, the two
alternating call by call, so a slow minute of this shared machine falls on both.

Per case: the best milliseconds a call of each build, GFLOP/s, the ratio, and whether
the two builds give every output the same bits (a kernel change that keeps each
output's sum in order must). The base build is `git show REV:runner/models/gemv_blocks.c`
compiled with the same flags; nothing else of REV is imported.

    python benchmarks/block_kernel.py [--base REV] [--rows 1,5,6,8,10,16,32,128]
        [--rounds 4] [--quick] [--out PATH]
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from runner import native  # noqa: E402
from runner.models import linear_blocks  # noqa: E402
from runner.models.linear import TorchLinear  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "block_kernel.json"
# (outputs, inputs, code bits): q and o, gate and up, down, the LM head (SmolLM2-135M;
# k and v are q's inputs with a third of its outputs).
SHAPES = [(576, 576, 4), (1536, 576, 4), (576, 1536, 4), (49152, 576, 8)]
QUICK_SHAPES = [(576, 576, 4), (192, 576, 8)]
MACS_PER_CALL = 2e8  # a case's calls a timing: about this many multiply-adds


def base_source(rev: str, into: Path) -> Path:
    """gemv_blocks.c as it was at `rev`, written under `into` (same file name: the
    build cache keys on the name and the contents)."""
    relative = linear_blocks.SOURCE.relative_to(ROOT).as_posix()
    text = subprocess.run(["git", "show", f"{rev}:{relative}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = into / linear_blocks.SOURCE.name
    path.write_text(text)
    return path


def gemv_of(source: Path) -> Any:
    """`specbudget_gemv_blocks` of `source`, built with the kernel's own flags."""
    lib = native.compiled(source, linear_blocks.FLAGS)
    gemv = lib.specbudget_gemv_blocks
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    gemv.argtypes = [i32, ptr, ptr, ptr, ptr, i64, i32, i32, i32, ptr, i64, ptr, i64, ptr]
    gemv.restype = i32
    return gemv


def measure_case(packed: Any, builds: dict[str, Any], rows: int, rounds: int) -> dict[str, Any]:
    """Best seconds a call per build, alternating builds round by round, and each
    build's output for one input."""
    x = torch.randn(rows, packed.in_features, generator=torch.Generator().manual_seed(rows))
    calls = max(1, int(MACS_PER_CALL / (rows * packed.in_features * packed.out_features)))
    best = dict.fromkeys(builds, float("inf"))
    outputs = {}
    names = list(builds)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            packed.gemv = builds[name]
            outputs[name] = packed(x)
            begin = time.perf_counter()
            for _ in range(calls):
                packed(x)
            best[name] = min(best[name], (time.perf_counter() - begin) / calls)
    flops = 2 * rows * packed.in_features * packed.out_features
    return {
        "rows": rows,
        **{f"{name}_ms": round(best[name] * 1e3, 4) for name in names},
        **{f"{name}_gflops": round(flops / best[name] / 1e9, 1) for name in names},
        "base_over_head": round(best["base"] / best["head"], 3),
        "same_bits": torch.equal(outputs["base"], outputs["head"]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--base", default="HEAD", help="the revision to compare against")
    parser.add_argument("--rows", default="1,5,6,8,10,16,32,128")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    args.out = out_path(args, DEFAULT_OUT)
    if not linear_blocks.available():
        raise SystemExit(f"the block kernel does not run here: {linear_blocks.load()[1]}")
    shapes, rows = SHAPES, [int(r) for r in args.rows.split(",")]
    if args.quick:
        shapes, rows, args.rounds = QUICK_SHAPES, [1, 6, 16], 2
    commit = subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"base": gemv_of(base_source(args.base, Path(tmp))),
                  "head": gemv_of(linear_blocks.SOURCE)}
    cases = []
    for outputs, inputs, bits in shapes:
        weight = linear_blocks.quantized(
            torch.randn(outputs, inputs, generator=torch.Generator().manual_seed(outputs))
            * 0.05, bits)
        packed = linear_blocks.BlockLinear(TorchLinear()).pack(weight, None)
        for row_count in rows:
            case = {"outputs": outputs, "inputs": inputs, "bits": bits,
                    **measure_case(packed, builds, row_count, args.rounds)}
            cases.append(case)
            print(f"{outputs:>6} x {inputs:<5} q{bits} {row_count:>4} rows: base "
                  f"{case['base_gflops']:6.1f}, head {case['head_gflops']:6.1f} GFLOP/s "
                  f"({case['base_over_head']:.2f}x){'' if case['same_bits'] else ', OTHER BITS'}",
                  flush=True)
    report = {"benchmark": "block_kernel", "quick": args.quick, "base": args.base,
              "base_commit": commit, "rounds": args.rounds,
              "threads": torch.get_num_threads(),
              "timed": "best seconds a call of each build, builds alternating",
              "cases": cases, "all_same_bits": all(c["same_bits"] for c in cases)}
    write_report(args.out, report)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
