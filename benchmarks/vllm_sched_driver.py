"""Replay a sched_trace trace through vLLM 0.33's real scheduler; runs inside .vllm-venv.

Imports vLLM, numpy and benchmarks/sched_trace.py only, never this repo's packages.
Builds `vllm.v1.core.sched.scheduler.Scheduler` as vLLM's EngineCore does (prefix
caching on, chunked prefill, synchronous scheduling) with no GPU and no weights, and
steps it like `EngineCore.step()` + `post_step()`: schedule(), a fake model runner
(sched_trace's model behaviour, not timed), update_from_output(), then
update_draft_token_ids() with the drafts (timed apart).

    .vllm-venv/bin/python benchmarks/vllm_sched_driver.py --trace T.json \
        [--methods off,ngram,parallel] [--out R.json]

Facts found while driving it (vLLM 0.33.0, CPU torch):
- VllmConfig needs DeviceConfig(device="cpu"): platform detection finds no device.
- SchedulerConfig.async_scheduling defaults to True (EngineCore then uses
  AsyncScheduler, with output placeholders); we set False for the synchronous path.
- A speculative config with a drafter model must be a SpeculativeConfig built with
  target_model_config and target_parallel_config (a plain dict reaches __post_init__
  without them). P-EAGLE = method "eagle3" + parallel_drafting; vLLM then switches to
  the V1 model runner ("Model Runner V2 does not yet support parallel drafting").
- Scheduler(vllm_config, kv_cache_config, structured_output_manager, block_size):
  the KVCacheConfig is one FullAttentionSpec group; block 0 is vLLM's null block.
- Prefix caching needs each Request built with a block_hasher
  (init_none_hash + get_request_block_hasher, as EngineCore does).
- The model runner returns drafts for every scheduled request; the scheduler drops
  those of prefill chunks (update_draft_token_ids), so we send them the same way.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The script's folder would shadow top-level names (benchmarks/common.py, ...) for
# vLLM's imports; load sched_trace from its file instead.
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path.pop(0)
_spec = importlib.util.spec_from_file_location("sched_trace", HERE / "sched_trace.py")
assert _spec is not None and _spec.loader is not None
sched_trace = importlib.util.module_from_spec(_spec)
sys.modules["sched_trace"] = sched_trace  # dataclasses look their module up here
_spec.loader.exec_module(sched_trace)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's logs off stdout

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

Trace, TraceRequest = sched_trace.Trace, sched_trace.TraceRequest
TimedStep, OutputLog, timed = sched_trace.TimedStep, sched_trace.OutputLog, sched_trace.timed

# A LlamaForCausalLM config and nothing else: ModelConfig inspects it, loads no weights.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "torch_dtype": "float16", "tie_word_embeddings": False,
}


def spec_dict(method: str, k: int, model_dir: str) -> dict | None:
    """Our method names in vLLM's terms: ngram as ours (prompt lookup 2..4), parallel
    = P-EAGLE (an EAGLE-3 head drafting all k in one pass)."""
    if method == "off":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if method == "parallel":
        return {"method": "eagle3", "model": model_dir, "num_speculative_tokens": k,
                "parallel_drafting": True}
    raise ValueError(f"no vLLM mapping for method {method!r}")


def drafter_rows(method: str, num_scheduled: dict[str, int], k: int) -> int:
    """Rows of the pass vLLM's drafter runs for this step. P-EAGLE appends k - 1 slots
    to every scheduled request, drafting or not (llm_base_proposer.py:
    total_num_output_tokens = total_num_input_tokens + net_num_new_slots_per_request
    * batch_size); ngram runs no model."""
    if method != "parallel":
        return 0
    return sum(num_scheduled.values()) + (k - 1) * len(num_scheduled)


def build_scheduler(trace: Trace, method: str, model_dir: str,
                    log_stats: bool, policy: str) -> Scheduler:
    limits = trace.config
    model = ModelConfig(model=model_dir, max_model_len=limits.max_model_len,
                        dtype="float16", skip_tokenizer_init=True)
    spec = spec_dict(method, limits.num_spec_tokens, model_dir)
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=trace.max_num_seqs,
            max_num_batched_tokens=trace.max_num_batched_tokens,
            max_model_len=limits.max_model_len, enable_chunked_prefill=True,
            is_encoder_decoder=False, async_scheduling=False, policy=policy),
        cache_config=CacheConfig(block_size=limits.block_size, enable_prefix_caching=True),
        speculative_config=None if spec is None else SpeculativeConfig(
            **spec, target_model_config=model, target_parallel_config=ParallelConfig()),
        device_config=DeviceConfig(device="cpu"))
    num_blocks = trace.num_blocks + 1  # + vLLM's null block: the same usable pool as ours
    config.cache_config.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn"], FullAttentionSpec(
            block_size=limits.block_size, num_kv_heads=2, head_size=64,
            dtype=torch.float16))])
    return Scheduler(vllm_config=config, kv_cache_config=kv,
                     structured_output_manager=StructuredOutputManager(config),
                     block_size=limits.block_size, log_stats=log_stats)


class VllmSide:
    """vLLM's scheduler stepped as EngineCore.step() + post_step() (sched_trace.Side)."""

    def __init__(self, trace: Trace, method: str, model_dir: str, log_stats: bool,
                 policy: str) -> None:
        self.method = method
        self.policy = policy
        self.k = trace.config.num_spec_tokens
        self.sched = build_scheduler(trace, method, model_dir, log_stats, policy)
        hash_fn = get_hash_fn_by_name(self.sched.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(
            trace.config.block_size, hash_fn, self.sched.vllm_config.num_hash_lookahead_tokens)
        self.trace_reqs: dict[str, TraceRequest] = {}
        self.log = OutputLog()

    def add(self, req: TraceRequest) -> None:
        self.trace_reqs[req.request_id] = req
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, temperature=0.0)
        self.sched.add_request(Request(
            req.request_id, list(req.prompt_token_ids), params, None,
            arrival_time=float(req.arrival_step), block_hasher=self.hasher,
            priority=req.priority() if self.policy == "priority" else 0))

    def num_unfinished(self) -> int:
        return self.sched.get_num_unfinished_requests()

    def _execute(self, out: SchedulerOutput) -> tuple[ModelRunnerOutput, list[list[int]]]:
        """Tokens per the trace; drafts for every scheduled request, as the runner."""
        req_ids = list(out.num_scheduled_tokens)
        sampled, drafts = [], []
        for rid in req_ids:
            request, behaviour = self.sched.requests[rid], self.trace_reqs[rid]
            # schedule() already advanced num_computed_tokens by the chunk.
            samples = request.num_computed_tokens >= request.num_tokens
            verified = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            tokens = behaviour.emitted(request.num_output_tokens, verified) if samples else []
            sampled.append(tokens)
            after = request.num_output_tokens + len(tokens)
            # vLLM's ngram proposer returns [] for a request that sampled nothing.
            drafts.append([] if self.method == "ngram" and not tokens
                          else behaviour.drafts(after, self.k))
        index = {rid: i for i, rid in enumerate(req_ids)}
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index=index,
                                 sampled_token_ids=sampled), drafts

    def step(self) -> TimedStep | None:
        out, schedule_us = timed(self.sched.schedule)
        if out.total_num_scheduled_tokens == 0:
            return None
        running = len(self.sched.running)
        result, drafts = self._execute(out)
        engine_outputs, update_us = timed(self.sched.update_from_output, out, result)
        draft_us = 0.0
        if self.method != "off" and not getattr(out, "skip_drafts", False):
            _, draft_us = timed(self.sched.update_draft_token_ids,
                                DraftTokenIds(result.req_ids, drafts))
        for client_outputs in engine_outputs.values():
            for output in client_outputs.outputs:
                self.log.add(output.request_id, output.new_token_ids)
        return TimedStep(schedule_us, update_us, draft_us, out.total_num_scheduled_tokens,
                          drafter_rows(self.method, out.num_scheduled_tokens, self.k), running)


def run(trace: Trace, methods: list[str], log_stats: bool = True,
        policy: str = "fcfs", collector: bool = True) -> dict:
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(
            json.dumps({**MODEL_CONFIG, "vocab_size": trace.config.vocab_size}))
        results = []
        for method in methods:
            side = VllmSide(trace, method, model_dir, log_stats, policy)
            records = sched_trace.replay(trace, side, collector=collector)
            results.append({"method": method,
                            **sched_trace.summarize(trace, records, side.log)})
    return {"side": "vllm", "vllm_version": vllm.__version__,
            "trace_fingerprint": trace.fingerprint(), "log_stats": log_stats, "policy": policy,
            "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True, help="sched_trace JSON")
    parser.add_argument("--methods", default="off,ngram,parallel")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default stdout)")
    parser.add_argument("--no-log-stats", action="store_true",
                        help="scheduler stats off (on by default, as `vllm serve`)")
    parser.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs")
    parser.add_argument("--no-gc", action="store_true", help="cyclic GC off in the replay")
    args = parser.parse_args()
    report = run(Trace.load(args.trace), args.methods.split(","), not args.no_log_stats,
                 args.policy, not args.no_gc)
    text = json.dumps(report, indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
