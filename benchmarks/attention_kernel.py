"""Paged attention time per forward: the torch path vs the compiled kernel of each device
(Triton on CUDA, runner/attention/cpu_kernel.py on the CPU), in milliseconds.

Shapes are SmolLM2-135M's attention (9 query heads over 3 KV heads, head_dim 64) with
block_size 16 and shuffled block tables; each timed call includes the K/V cache write.
On CUDA (bf16): decode batches of 1/8/32/128 requests at context 1k and 4k, and one
512-token prefill, with torch/triton ratios and the largest output difference. On the
CPU, in the serving dtype (bfloat16 where native): decodes of 1/16/64 requests at 256
keys and 64 at 1k, 16 verifications of 5 rows, a 512-row prefill and a 256-row chunk
after 1k cached keys, torch/cpu ratios. The torch path's time reuses its plan (one per
pass, shared by every layer); `torch_plan_ms` is the plan.

    python benchmarks/attention_kernel.py [--quick] [--out PATH]
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from runner.attention import AttentionBackend, AttentionMetadata  # noqa: E402
from runner.attention.torch_paged import TorchPagedAttention  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "attention_kernel.json"

# (case, batch, context, query tokens per request); context counts the new tokens too.
CUDA_CASES = [("decode", b, ctx, 1) for ctx in (1024, 4096) for b in (1, 8, 32, 128)]
CUDA_CASES.append(("prefill", 1, 512, 512))
CUDA_QUICK = [("decode", 8, 1024, 1), ("prefill", 1, 512, 512)]
CPU_CASES = [("decode", 1, 256, 1), ("decode", 16, 256, 1), ("decode", 64, 256, 1),
             ("decode", 64, 1024, 1), ("verify", 16, 256, 5), ("prefill", 1, 512, 512),
             ("chunk", 1, 1280, 256)]
CPU_QUICK = [("decode", 2, 64, 1), ("prefill", 1, 32, 32)]


Tensors5 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_inputs(batch: int, context: int, num_q: int, dtype: torch.dtype, device: str,
                seed: int = 0) -> tuple[Tensors5, AttentionMetadata]:
    """(query, key, value, key_cache, value_cache) and metadata for `batch` equal requests."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    table = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_req)
    positions = torch.arange(context - num_q, context)
    # slot of position p = table[req, p // bs] * bs + p % bs, for this step's tokens
    slots = table[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    num_tokens = batch * num_q

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    kv_shape = (num_tokens, NUM_KV_HEADS, HEAD_DIM)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    tensors: Tensors5 = (randn(num_tokens, NUM_HEADS, HEAD_DIM), randn(*kv_shape),
                         randn(*kv_shape), randn(*cache_shape), randn(*cache_shape))
    query_start_loc = list(range(0, num_tokens + 1, num_q))
    meta = AttentionMetadata(
        num_actual_tokens=num_tokens, num_reqs=batch,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_table=table.to(device=device, dtype=torch.int32),
        slot_mapping=slots.flatten().to(device),
        max_query_len=num_q, max_seq_len=context,
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=[context] * batch,
    )
    return tensors, meta


def time_ms(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median wall time of one call; CUDA calls are synchronised around each one."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def run_case(case: tuple[str, int, int, int], backends: dict[str, AttentionBackend],
             dtype: torch.dtype, device: str, warmup: int, repeats: int) -> dict:
    name, batch, context, num_q = case
    tensors, meta = make_inputs(batch, context, num_q, dtype, device)
    scale = HEAD_DIM ** -0.5
    record: dict = {"case": name, "batch": batch, "context": context, "query_tokens": num_q}
    outs = {}
    for label, backend in backends.items():
        def call(backend: AttentionBackend = backend) -> torch.Tensor:
            return backend.forward(*tensors, meta, scale)

        outs[label] = call()
        record[f"{label}_ms"] = round(time_ms(call, warmup, repeats), 4)
    torch_backend = backends["torch"]
    if isinstance(torch_backend, TorchPagedAttention):  # the plan, built once per pass
        shape = (BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS)

        def plan(backend: TorchPagedAttention = torch_backend) -> object:
            backend._plans = None  # as a new pass's metadata would
            return backend._split(meta, shape)

        record["torch_plan_ms"] = round(time_ms(plan, warmup, repeats), 4)
    for kernel in ("triton", "cpu"):
        if kernel in outs:
            diff = (outs[kernel].float() - outs["torch"].float()).abs().max().item()
            record["max_abs_diff"] = float(f"{diff:.3g}")
            record[f"torch_over_{kernel}"] = round(record["torch_ms"] / record[f"{kernel}_ms"], 2)
    return record


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.out = out_path(args, DEFAULT_OUT)
    backends: dict[str, AttentionBackend] = {"torch": TorchPagedAttention()}
    if torch.cuda.is_available():
        from runner.attention.triton_paged import TritonPagedAttention

        backends["triton"] = TritonPagedAttention()
        device, dtype, cases = "cuda", torch.bfloat16, CUDA_QUICK if args.quick else CUDA_CASES
        triton_note = "timed"
    else:
        from runner.attention import cpu_kernel
        from runner.config import RunnerConfig

        if cpu_kernel.available():
            from runner.attention.cpu_paged import CpuPagedAttention

            backends["cpu"] = CpuPagedAttention()
        dtype = RunnerConfig().torch_dtype  # what the CPU serves in
        device, cases = "cpu", CPU_QUICK if args.quick else CPU_CASES
        triton_note = "not timed: the Triton path needs CUDA (interpreted Triton is no timing)"
    warmup, repeats = (1, 3) if args.quick else (3, 20)
    records = [run_case(c, backends, dtype, device, warmup, repeats) for c in cases]
    device_name = (torch.cuda.get_device_name() if device == "cuda"
                   else platform.processor() or platform.machine())
    report = {
        "benchmark": "attention_kernel",
        "quick": args.quick,
        "device": device_name,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE},
        "timed": "one forward (cache write + attention), median of repeats, milliseconds",
        "repeats": repeats,
        "triton": triton_note,
        "torch": torch.__version__,
        "results": records,
    }
    write_report(args.out, report)
    for r in records:
        kernel = next((k for k in ("triton", "cpu") if f"{k}_ms" in r), None)
        extra = (f"  {kernel} {r[f'{kernel}_ms']:8.3f} ms  torch/{kernel} "
                 f"{r[f'torch_over_{kernel}']:.2f}x" if kernel else "")
        print(f"{r['case']:<8}batch {r['batch']:>4}  context {r['context']:>5}  "
              f"rows {r['query_tokens']:>4}  "
              f"torch {r['torch_ms']:8.3f} ms (plan {r['torch_plan_ms']:.3f}){extra}")
    print(f"triton: {triton_note}\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
