"""A/B of goodput policy settings, side by side: speculation off, goodput as configured,
goodput with each variant's `GoodputSettings` overrides, and fixed K = 1, stepped in
turn over the same held-out prompts (`engine.stepwise.run_side_by_side`), fresh
engines each pass. Every figure is output tok/s / off in the same pass (medians over
passes), so the machine's drift cancels; every run must be token-identical to off.

    python benchmarks/goodput_ab.py --runs dflash:4:8:4,eagle:64:64:2 \\
        --variant finish_min_running=1 --variant finish_when_closed=False

A run is METHOD:RUNNING:REQUESTS:PASSES; a variant is KEY=VALUE[;KEY=VALUE...] with
values as Python literals. JSON: benchmarks/results/goodput_ab.json (or --out).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import spec_decode as sd  # noqa: E402
from engine.stepwise import run_side_by_side  # noqa: E402
from runner.config import RunnerConfig  # noqa: E402
from runner.model_loader import load_model  # noqa: E402
from runner.model_prep import resolve_model  # noqa: E402
from runner.models.llama import LlamaForCausalLM  # noqa: E402
from scheduler import SamplingParams  # noqa: E402
from scheduler.config import GoodputSettings  # noqa: E402
from training.prompts import instructions  # noqa: E402


def parse_variant(text: str) -> dict[str, object]:
    """KEY=VALUE[;KEY=VALUE...] into GoodputSettings overrides, each checked to name a
    setting (a typo would silently A/B the default against itself)."""
    known = {f.name for f in dataclasses.fields(GoodputSettings)}
    over: dict[str, object] = {}
    for item in filter(None, text.split(";")):
        key, _, value = item.partition("=")
        if key not in known:
            raise SystemExit(f"--variant: {key!r} is not a GoodputSettings field")
        over[key] = ast.literal_eval(value)
    return over


def one_pass(model: LlamaForCausalLM, method: str, running: int, prompts: list[str],
             head: str | None, variants: list[dict[str, object]],
             max_tokens: int) -> tuple[list[float], bool]:
    """Each engine's tok/s / off's for one side-by-side pass (goodput, the variants,
    fixed K = 1), and whether every engine's tokens were off's."""
    configs = ([(None, "off", 4, None), (method, "goodput", 4, head)]
               + [(method, "goodput", 4, head)] * len(variants) + [(method, "fixed", 1, head)])
    engines = [sd.engine_for(model, c, running) for c in configs]
    for engine, over in zip(engines[2:2 + len(variants)], variants, strict=True):
        policy = engine.engine.scheduler.policy
        assert policy is not None
        policy.settings = dataclasses.replace(policy.settings, **over)  # type: ignore[arg-type]
    chats = [engines[0].tokenizer.apply_chat_template([{"role": "user", "content": p}])
             for p in prompts]
    seconds, outs = run_side_by_side(engines, chats, SamplingParams(max_tokens=max_tokens))
    tokens = [[o.outputs[0].token_ids for o in run] for run in outs]
    return [seconds[0] / s for s in seconds[1:]], all(t == tokens[0] for t in tokens)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True,
                        help="comma-separated METHOD:RUNNING:REQUESTS:PASSES")
    parser.add_argument("--variant", action="append", default=[],
                        help="KEY=VALUE[;KEY=VALUE...] GoodputSettings overrides")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / "goodput_ab.json")
    args = parser.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    names = (["goodput"] + [";".join(f"{k}={v}" for k, v in o.items()) for o in variants]
             + ["fixed K=1"])
    path = resolve_model(None)
    model = load_model(path, RunnerConfig(device="cpu", dtype="auto").torch_dtype,
                       torch.device("cpu"))
    prompts = instructions("eval")
    rows = []
    for run in args.runs.split(","):
        method, running, requests, passes = run.split(":")
        num = max(int(running), min(int(requests), len(prompts)))
        batch = (prompts * int(running))[:num]
        head = sd.head_variants(method, path, False)[0]
        ratios: dict[str, list[float]] = {n: [] for n in names}
        identical = True
        for i in range(int(passes)):
            got, same = one_pass(model, method, int(running), batch, head, variants,
                                 args.max_tokens)
            identical &= same
            for name, ratio in zip(names, got, strict=True):
                ratios[name].append(round(ratio, 4))
            print(run, i, "  ".join(f"{n} {r[-1]:.3f}" for n, r in ratios.items()),
                  "identical" if same else "DIFFERS", flush=True)
        medians = {n: round(statistics.median(r), 4) for n, r in ratios.items()}
        print("median", run, "  ".join(f"{n} {m:.3f}" for n, m in medians.items()), flush=True)
        rows.append({"run": run, "method": method, "running": int(running),
                     "requests": num, "passes": int(passes), "identical": identical,
                     "median_vs_off": medians, "passes_vs_off": ratios})
    result = {"variants": names, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
