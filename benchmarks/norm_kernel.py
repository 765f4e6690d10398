"""RMSNorm through the compiled call (runner/models/cpu_ops.py) against torch's
`F.rms_norm`, through the engine, at one request: output tok/s with speculation off and
with eagle at fixed K (its trained head, where the model cache has one), every
configuration stepped side by side (engine/stepwise.py) on held-out instructions.

The torch variant is the same packed model with its norms (the target's and the
head's) handed back to `F.rms_norm`; nothing else differs. Ratios within the run are
the figure (this machine's speed drifts). Also: where each compiled configuration's
outputs first part from its torch twin's (`greedy_equality.compare`: the norms round
alike in all but a few elements in 100,000, so greedy outputs may part late in an
answer).

    python benchmarks/norm_kernel.py [--quick] [--prompts N] [--max-tokens T] [--out PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from benchmarks.greedy_equality import compare  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.stepwise import run_side_by_side  # noqa: E402
from runner.drafter import find_trained_head  # noqa: E402
from runner.model_prep import resolve_model  # noqa: E402
from runner.models.cpu_ops import load  # noqa: E402
from runner.models.llama import RMSNorm  # noqa: E402
from scheduler import SamplingParams  # noqa: E402
from training.prompts import instructions  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "norm_kernel.json"


def _norms(llm: LLM) -> list[RMSNorm]:
    runner = llm.engine.runner
    nets = [runner.model, getattr(getattr(runner.spec, "drafter", None), "net", None)]
    return [m for net in nets if net is not None for m in net.modules()
            if isinstance(m, RMSNorm)]


def norm_kinds(llm: LLM) -> list[str]:
    """What the engine's norms run: "CompiledNorm" (packed) or "torch" (unpacked)."""
    return sorted({type(n._packed).__name__ if n._packed is not None else "torch"
                   for n in _norms(llm)})


def _engine(spec: dict[str, Any] | None, compiled: bool) -> LLM:
    """An engine on its own copy of the default model, its norms compiled or torch's."""
    llm = LLM(speculative_config=spec, max_num_seqs=1,
              max_num_batched_tokens=256, max_model_len=1024)
    for norm in _norms(llm):
        norm.pack()
        if not compiled:
            norm._packed = None  # torch's F.rms_norm, as an unpacked RMSNorm runs
    llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    return llm


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens = 2, 8
    if load()[0] is None:
        raise SystemExit(f"the compiled norm is unavailable here: {load()[1]}")
    specs: dict[str, dict[str, Any] | None] = {"off": None}
    if find_trained_head(resolve_model(None), "eagle") is not None:
        specs["eagle"] = {"method": "eagle", "num_speculative_tokens": args.k,
                          "draft_policy": "fixed"}
    configs = [(name, compiled) for name in specs for compiled in (True, False)]
    engines = [_engine(specs[name], compiled) for name, compiled in configs]
    kinds = [norm_kinds(llm) for llm in engines]
    try:
        prompts = [engines[0].tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in instructions("eval")[:args.prompts]]
        seconds, outs = run_side_by_side(
            engines, prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    finally:
        for llm in engines:
            llm.close()
    tokens = [[list(o.outputs[0].token_ids) for o in got] for got in outs]
    rows: dict[str, dict[str, Any]] = {}
    for i, (name, compiled) in enumerate(configs):
        rows.setdefault(name, {})["compiled" if compiled else "torch"] = {
            "tokens_per_s": round(sum(map(len, tokens[i])) / seconds[i], 2),
            "output_tokens": sum(map(len, tokens[i])), "norms": kinds[i]}
    for i in range(0, len(configs), 2):
        row = rows[configs[i][0]]
        row["compiled_over_torch"] = round(row["compiled"]["tokens_per_s"]
                                           / row["torch"]["tokens_per_s"], 3)
        # Where the compiled norm's greedy outputs part from torch's (greedy_equality's
        # comparison, torch's outputs the reference).
        row["against_torch"] = compare(tokens[i + 1], tokens[i])
    if "eagle" in rows:  # speculation must not change a greedy output, either norm
        for compiled in (0, 1):
            rows["eagle"]["lossless_" + ("torch" if compiled else "compiled")] = (
                tokens[2 + compiled] == tokens[compiled])
    report = {"benchmark": "norm_kernel", "quick": args.quick, "prompts": args.prompts,
              "max_tokens": args.max_tokens, "k": args.k, "concurrency": 1,
              "timed": "each configuration's own engine steps, side by side", "results": rows}
    write_report(out_path(args, DEFAULT_OUT), report)
    print(report)
    return report


if __name__ == "__main__":
    main()
