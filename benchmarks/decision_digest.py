"""One digest of every scheduling decision over many seeded runs: proof that a refactor
of the scheduler decides exactly what it did before.

Each case draws a method (or none), K, policy, KV pool (tight pools preempt), chunked
prefill, long-prefill threshold, draft policy and budget, then replays random arrivals,
priorities, stop tokens and aborts through the Scheduler and a seeded SimulatedRunner
(the strict one: each pass checked against B). Every SchedulerOutput (order included)
and every update is hashed. Run it on two commits and compare the digests:

    python benchmarks/decision_digest.py [--cases N] [--quick] [--out PATH] [--no-park]

`--no-park` runs every method with `park_drafter=False`: the decisions of commits from
before requests could be parked (whose digest the default run no longer matches:
a parked request charges its drafter passes nothing).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from runner.simulated import SimulatedRunner  # noqa: E402
from scheduler import (  # noqa: E402
    CacheConfig,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from spec_decode import METHODS, SpeculativeConfig  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "decision_digest.json"
STEPS = 150


def _decisions(out: SchedulerOutput) -> str:
    """Everything the scheduler decided in one step, in its order."""
    return repr((list(out.num_scheduled_tokens.items()), out.num_draft_tokens, out.pass_rows,
                 out.num_drafter_tokens, out.adapted_draft_tokens,
                 sorted(out.preempted_req_ids), sorted(out.finished_req_ids),
                 [(n.req_id, n.block_ids, n.num_computed_tokens)
                  for n in out.scheduled_new_reqs],
                 out.scheduled_cached_reqs, out.scheduled_spec_decode_tokens))


def replay_case(rng: random.Random, digest: hashlib._Hash, park: bool = True) -> None:
    method = rng.choice([None, *METHODS])
    k = rng.randint(1, 5)
    chunked = rng.random() < 0.7
    budget = (2 * k + 2 if method else 1) + rng.choice([0, 8, 64])
    budget = budget if chunked else max(budget, 128)
    policy, blocks = rng.choice(["fcfs", "priority"]), rng.choice([40, 60, 400])
    threshold, fit, seed = rng.choice([0, 2, 16]), rng.random() < 0.3, rng.randrange(1000)
    spec = SpeculativeConfig(method, k, draft_policy="fit" if fit else "fixed",
                             park_drafter=park) if method else None
    sched = Scheduler(SchedulerConfig(budget, 6, 128, chunked, policy,
                                      long_prefill_token_threshold=threshold),
                      CacheConfig(block_size=4, num_blocks=blocks), spec)
    runner = SimulatedRunner(sched, vocab_size=40, acceptance=0.6,
                                           eos_token_id=2, eos_prob=0.02, seed=seed)
    work = random.Random(seed)
    for next_id in range(STEPS):
        if work.random() < 0.5:
            prompt = [3 + work.randrange(30) for _ in range(work.randint(1, 60))]
            params = SamplingParams(max_tokens=work.randint(1, 40), stop_token_ids=(
                (work.randrange(3, 40),) if work.random() < 0.2 else ()))
            with contextlib.suppress(ValueError):  # a refusal is part of the trace too
                sched.add_request(Request(f"r{next_id}", prompt, params, 2,
                                          work.randrange(3), float(next_id)))
        if work.random() < 0.05 and sched.requests:
            sched.abort_request(work.choice(sorted(sched.requests)))
        out = sched.schedule()
        digest.update(_decisions(out).encode())
        digest.update(repr(sched.update_from_output(out, runner.execute(out))).encode())


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-park", action="store_true",
                        help="park_drafter=False for every method (see the docstring)")
    args = parser.parse_args(argv)
    cases = 20 if args.quick else args.cases
    rng, digest = random.Random(args.seed), hashlib.sha256()
    for _ in range(cases):
        replay_case(rng, digest, park=not args.no_park)
    report = {"cases": cases, "seed": args.seed, "steps_per_case": STEPS,
              "park_drafter": not args.no_park, "digest": digest.hexdigest()}
    write_report(out_path(args, DEFAULT_OUT), report)
    print(report["digest"])
    return report


if __name__ == "__main__":
    main()
