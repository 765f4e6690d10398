"""The GGUF-block linear kernel (runner/models/gemv_blocks.c) of this checkout against
the same file at another revision, in one process: each build runs every layer shape of
the default model (Q4_1 projections, the Q8_0 LM head) at several row counts, the two
alternating call by call, so a slow minute of this shared machine falls on both.

Per case: the best milliseconds a call of each build, GFLOP/s, the ratio, and whether
the two builds give every output the same bits (a kernel change that keeps each
output's sum in order must). The base build is `git show REV:runner/models/gemv_blocks.c`
compiled with the same flags; nothing else of REV is imported.

A case calls one weight again and again, so after its first call the weight is in the
caches. A decode step is not like that: it streams the model's 96 MB of blocks once,
each weight cold, which rewards a different loop. `--sweep` times that instead: every
call a whole model's linear layers in a forward's order (SmolLM2-135M's 30 layers of
fused q/k/v, o, fused gate/up and down, then the LM head; random weights of the same
blocks), at each row count, the builds alternating sweep by sweep; the figure is each
build's median sweep.

`--engine` measures what a user sees: the default model served at one request, greedy,
on held-out instructions, by two engines sharing one loaded model, each step of one run
on the base build and each of the other's on this checkout's (every packed layer is
switched before the step), stepped side by side (`engine/stepwise.py`), who goes first
alternating by round; speculation off, and `--method` (its trained head at K = 4, the
default policy) beside it if named. Per round: each engine's tok/s, head over base, and
whether the outputs are the same.

    python benchmarks/block_kernel.py [--base REV] [--rows 1,5,6,8,10,16,32,128]
        [--rounds 4] [--sweep | --engine [--method eagle] [--prompts 12]
        [--max-tokens 64]] [--quick] [--out PATH]
"""

from __future__ import annotations

import ctypes
import statistics
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
# A decoder layer as the runner packs it: fused q/k/v (576 + 2 x 192 outputs), o, fused
# gate/up, down; the model has 30, then its LM head.
LAYER = [(960, 576, 4), (576, 576, 4), (3072, 576, 4), (576, 1536, 4)]
NUM_LAYERS = 30
LM_HEAD = (49152, 576, 8)
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


def packed_weight(outputs: int, inputs: int, bits: int, seed: int) -> Any:
    """A random weight of that shape, quantized to `bits`-bit blocks and packed."""
    weight = linear_blocks.quantized(
        torch.randn(outputs, inputs, generator=torch.Generator().manual_seed(seed)) * 0.05,
        bits)
    return linear_blocks.BlockLinear(TorchLinear()).pack(weight, None)


def measure_sweep(layers: list[Any], builds: dict[str, Any], rows: int,
                  rounds: int) -> dict[str, Any]:
    """Median seconds of a sweep through `layers` (each called once on `rows` rows) per
    build, the builds alternating sweep by sweep, and whether every layer's output has
    the same bits under both."""
    inputs = {layer.in_features for layer in layers}
    x = {k: torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
         for k in inputs}
    names = list(builds)
    same = True
    for layer in (layers[0], layers[3], layers[-1]):
        outs = []
        for name in names:
            layer.gemv = builds[name]
            outs.append(layer(x[layer.in_features]))
        same = same and torch.equal(outs[0], outs[1])
    took: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            for layer in layers:
                layer.gemv = builds[name]
            begin = time.perf_counter()
            for layer in layers:
                layer(x[layer.in_features])
            took[name].append(time.perf_counter() - begin)
    medians = {name: statistics.median(took[name]) for name in names}
    weight_bytes = sum(layer.codes.numel() * layer.codes.element_size()
                       + layer.scales.numel() * layer.scales.element_size()
                       + (0 if layer.minimums is None else
                          layer.minimums.numel() * layer.minimums.element_size())
                       for layer in layers)
    return {
        "rows": rows,
        **{f"{name}_ms": round(medians[name] * 1e3, 3) for name in names},
        **{f"{name}_gb_per_s": round(weight_bytes / medians[name] / 1e9, 2) for name in names},
        "base_over_head": round(medians["base"] / medians["head"], 3),
        "same_bits": same,
    }


def sweep_cases(builds: dict[str, Any], rows: list[int], rounds: int,
                quick: bool) -> list[dict[str, Any]]:
    """`--sweep`: the model's layers in a forward's order at each row count."""
    layer_shapes = LAYER * (1 if quick else NUM_LAYERS) + [QUICK_SHAPES[1] if quick else LM_HEAD]
    layers = [packed_weight(o, i, b, seed) for seed, (o, i, b) in enumerate(layer_shapes)]
    cases = []
    for row_count in rows:
        case = measure_sweep(layers, builds, row_count, rounds)
        cases.append(case)
        print(f"model sweep {row_count:>4} rows: base {case['base_ms']:7.2f}, head "
              f"{case['head_ms']:7.2f} ms ({case['base_over_head']:.2f}x)"
              f"{'' if case['same_bits'] else ', OTHER BITS'}", flush=True)
    return cases


def engine_rounds(builds: dict[str, Any], method: str | None, num_prompts: int,
                  max_tokens: int, rounds: int) -> list[dict[str, Any]]:
    """`--engine`: off (and `method`) on each build, stepped side by side."""
    from runner.config import RunnerConfig
    from runner.eagle3 import trained_head_dir
    from runner.model_loader import load_model
    from runner.model_prep import resolve_model
    from training.served import served_engine

    path = resolve_model(None)
    model = load_model(path, RunnerConfig().torch_dtype)
    configs: dict[str, dict[str, Any] | None] = {"off": None}
    if method:
        configs[method] = {"method": method, "num_speculative_tokens": 4,
                           "model": str(trained_head_dir(path, method))}
    engines = {(name, build): served_engine(model, spec)
               for name, spec in configs.items() for build in builds}
    try:
        return _engine_rounds(engines, model, builds, configs, num_prompts, max_tokens,
                              rounds)
    finally:  # each engine's KV cache released, as training/served.py's side_by_side does
        for llm in engines.values():
            llm.close()


def _engine_rounds(engines: dict[tuple[str, str], Any], model: Any,
                   builds: dict[str, Any], configs: dict[str, Any], num_prompts: int,
                   max_tokens: int, rounds: int) -> list[dict[str, Any]]:
    from engine.stepwise import run_side_by_side
    from scheduler import SamplingParams
    from training.prompts import instructions

    layers = [v for m in model.modules() for v in vars(m).values()
              if isinstance(v, linear_blocks._BlocksPacked)]
    for (_, build), llm in engines.items():
        _step_on(llm, layers, builds[build])
    tokenizer = next(iter(engines.values())).tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}])
               for p in instructions("eval")[:num_prompts]]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = []
    for round_ in range(rounds):
        order = list(engines) if round_ % 2 == 0 else list(engines)[::-1]
        seconds, outputs = run_side_by_side([engines[key] for key in order], prompts, params)
        got = dict(zip(order, zip(seconds, outputs, strict=True), strict=True))
        row: dict[str, Any] = {"round": round_}
        for name in configs:
            (base_s, base_out), (head_s, head_out) = got[(name, "base")], got[(name, "head")]
            tokens = sum(len(o.outputs[0].token_ids) for o in head_out)
            row[name] = {"base_tok_s": round(tokens / base_s, 2),
                         "head_tok_s": round(tokens / head_s, 2),
                         "head_over_base": round(base_s / head_s, 3),
                         "same_outputs": ([o.outputs[0].token_ids for o in base_out]
                                          == [o.outputs[0].token_ids for o in head_out])}
        out.append(row)
        print(f"round {round_}: " + "; ".join(
            f"{name} base {row[name]['base_tok_s']}, head {row[name]['head_tok_s']} tok/s "
            f"({row[name]['head_over_base']:.3f}x)" for name in configs), flush=True)
    return out


def _step_on(llm: Any, layers: list[Any], gemv: Any) -> None:
    """Every step of `llm` runs `layers` on `gemv` (the engines share the model)."""
    step = llm.engine.step

    def stepped(*args: Any, **kwargs: Any) -> Any:
        for layer in layers:
            layer.gemv = gemv
        return step(*args, **kwargs)

    llm.engine.step = stepped


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--base", default="HEAD", help="the revision to compare against")
    parser.add_argument("--rows", default="1,5,6,8,10,16,32,128")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sweep", action="store_true",
                        help="time whole-model sweeps, each weight cold (see above)")
    parser.add_argument("--engine", action="store_true",
                        help="the engine's tok/s on each build (see above)")
    parser.add_argument("--method", default=None)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
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
    if args.engine:
        if args.quick:
            args.prompts, args.max_tokens = 2, 8
        report = {"benchmark": "block_kernel", "mode": "engine", "quick": args.quick,
                  "base": args.base, "base_commit": commit, "method": args.method,
                  "prompts": args.prompts, "max_tokens": args.max_tokens,
                  "threads": torch.get_num_threads(),
                  "rounds": engine_rounds(builds, args.method, args.prompts,
                                          args.max_tokens, args.rounds)}
        write_report(args.out, report)
        print(f"wrote {args.out}")
        return report
    cases = sweep_cases(builds, rows, args.rounds, args.quick) if args.sweep else []
    for outputs, inputs, bits in ([] if args.sweep else shapes):
        packed = packed_weight(outputs, inputs, bits, outputs)
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
              "timed": ("median seconds of a whole-model sweep, each weight cold, builds "
                        "alternating" if args.sweep
                        else "best seconds a call of each build, builds alternating"),
              "cases": cases, "all_same_bits": all(c["same_bits"] for c in cases)}
    write_report(args.out, report)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
