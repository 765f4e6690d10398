"""One digest of every scheduling decision over many seeded runs: proof that a refactor
of the scheduler decides exactly what it did before.

Each case draws a method (or none), K, policy, KV pool (tight pools preempt), chunked
prefill, long-prefill threshold, draft policy and budget, then replays random arrivals,
priorities, stop tokens and aborts through the Scheduler and a seeded SimulatedRunner
(the strict one: each pass checked against B). Every SchedulerOutput (order included)
and every update is hashed. Run it on two commits and compare the digests:

    python benchmarks/decision_digest.py [--cases N] [--quick] [--out PATH] [--no-park]
                                         [--no-goodput]

Goodput, the default draft policy, decides from what it learns: its cases also draw the
simulated acceptance and step time (a deterministic clock, `synthetic_step_time`) and
how soon the learnt request weight takes over, from a generator of their own, so the
other cases draw exactly what they drew before goodput was in the digest.
`--no-goodput` leaves goodput out (fixed and fit only): the digest of commits before
it was (1b69cb1... at 300 cases, seed 1). `--no-park` runs every method with
`park_drafter=False`: the decisions of commits from before requests could be parked
(a parked request charges its drafter passes nothing).
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
from engine.simulate import synthetic_step_time  # noqa: E402
from runner.simulated import SimulatedRunner  # noqa: E402
from scheduler import (  # noqa: E402
    CacheConfig,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from scheduler.config import GoodputSettings  # noqa: E402
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


def replay_case(rng: random.Random, digest: hashlib._Hash, park: bool = True,
                goodput: bool = True) -> None:
    method = rng.choice([None, *METHODS])
    k = rng.randint(1, 5)
    chunked = rng.random() < 0.7
    budget = (2 * k + 2 if method else 1) + rng.choice([0, 8, 64])
    budget = budget if chunked else max(budget, 128)
    policy, blocks = rng.choice(["fcfs", "priority"]), rng.choice([40, 60, 400])
    threshold, fit, seed = rng.choice([0, 2, 16]), rng.random() < 0.3, rng.randrange(1000)
    draft_policy = "fit" if fit else "fixed"
    # Goodput's own draws come from a generator seeded by the case, not from `rng`.
    learn = random.Random(seed * 7919 + 13)
    acceptance, step_time, settings = 0.6, None, None
    if goodput and method and learn.random() < 0.5:
        draft_policy, acceptance = "goodput", learn.choice([0.05, 0.4, 0.6, 0.95])
        step_time = synthetic_step_time(0.02, learn.choice([0.00005, 0.0003, 0.004]))
        settings = GoodputSettings(spread_min_requests=learn.choice([2, 16]))
    spec = SpeculativeConfig(method, k, draft_policy=draft_policy,
                             park_drafter=park) if method else None
    sched = Scheduler(SchedulerConfig(budget, 6, 128, chunked, policy,
                                      long_prefill_token_threshold=threshold),
                      CacheConfig(block_size=4, num_blocks=blocks), spec, goodput=settings)
    runner = SimulatedRunner(sched, vocab_size=40, acceptance=acceptance,
                             eos_token_id=2, eos_prob=0.02, seed=seed, step_time=step_time)
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
    parser.add_argument("--no-goodput", action="store_true",
                        help="fixed and fit draft policies only (see the docstring)")
    args = parser.parse_args(argv)
    cases = 20 if args.quick else args.cases
    rng, digest = random.Random(args.seed), hashlib.sha256()
    for _ in range(cases):
        replay_case(rng, digest, park=not args.no_park, goodput=not args.no_goodput)
    report = {"cases": cases, "seed": args.seed, "steps_per_case": STEPS,
              "park_drafter": not args.no_park, "goodput": not args.no_goodput,
              "digest": digest.hexdigest()}
    write_report(out_path(args, DEFAULT_OUT), report)
    print(report["digest"])
    return report


if __name__ == "__main__":
    main()
