"""Where serving drafts, against where held-out agreement is counted: a trained eagle
head's first draft at the positions where serving started a draft, and at every
position, teacher-forced.

The held-out instructions are served one at a time at fixed K (greedy); every
verification's first draft and how many drafts it accepted are recorded. Then, for
every position p of each answer, the prompt and the answer up to p are prefilled as a
fresh request and the first draft the drafter proposes from that whole context is
read: the teacher-forced draft (the drafter's KV written from the target's features
of every earlier position, as training computes it). Reported:

- how often the served first draft equals the teacher-forced one at the same position
  (1.0 unless serving's drafter state departs from training's);
- the first draft's acceptance at the positions serving drafted from, and at every
  position (what held-out agreement averages over).

    python benchmarks/draft_starts.py [--quick] [--prompts 12] [--max-tokens 64]
        [--head DIR] [--out PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the repo's packages importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_parser, out_path, write_report  # noqa: E402
from engine.llm import LLM  # noqa: E402
from scheduler import SamplingParams  # noqa: E402
from training.prompts import instructions  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "draft_starts.json"

Step = tuple[list[int], list[int]]  # (tokens the step emitted, the drafts it proposed)


def record_steps(llm: LLM) -> list[Step]:
    """The list every later step of `llm` appends its (emitted, drafts) to (one request
    at a time)."""
    steps: list[Step] = []
    runner = llm.engine.runner
    execute = runner.execute

    def recorded(scheduled: Any) -> Any:
        out = execute(scheduled)
        if out is not None and out.req_ids:
            steps.append((list(out.sampled_token_ids[0]),
                          list(out.draft_token_ids.get(out.req_ids[0], []))))
        return out

    runner.execute = recorded  # type: ignore[method-assign]
    return steps


def served_starts(steps: list[Step], answer_len: int) -> list[tuple[int, int, int]]:
    """(answer position the drafts start at, the first draft, drafts accepted) of each
    verification: a step's drafts guess the answer from the tokens emitted so far."""
    starts, emitted, pending = [], 0, None
    for sampled, drafts in steps:
        if pending is not None:
            starts.append((emitted, pending, len(sampled) - 1))
        emitted += len(sampled)
        pending = drafts[0] if drafts and emitted < answer_len else None
    return starts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--head", default=None, help="head dir (default: the trained one)")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens = 1, 12
    spec = {"method": "eagle", "model": args.head, "num_speculative_tokens": args.k,
            "draft_policy": "fixed"}
    llm = LLM(speculative_config=spec, max_num_seqs=1, max_num_batched_tokens=1024,
              max_model_len=1024, enable_prefix_caching=False)
    try:
        steps = record_steps(llm)
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        served, forced = [], {}
        for i, text in enumerate(instructions("eval")[:args.prompts]):
            prompt = llm.tokenizer.encode(
                llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
            steps.clear()
            answer = list(llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
                          .token_ids)
            served += [(i, p, draft, acc) for p, draft, acc in served_starts(steps, len(answer))]
            # A fresh request over prompt + answer[:q]: its prefill step emits answer[q]
            # and drafts answer[q + 1] from the whole context (K + 2 tokens asked, so the
            # budget leaves it drafts to propose).
            for q in range(len(answer) - 1):
                steps.clear()
                llm.generate([prompt + answer[:q]],
                             SamplingParams(max_tokens=args.k + 2, temperature=0.0),
                             use_tqdm=False)
                if steps and steps[0][1]:
                    forced[(i, q + 1)] = (steps[0][1][0], answer[q + 1])
    finally:
        llm.close()
    at_starts = [forced[(i, p)] for i, p, _, _ in served if (i, p) in forced]
    report = {
        "benchmark": "draft_starts", "quick": args.quick, "prompts": args.prompts,
        "max_tokens": args.max_tokens, "k": args.k, "head": args.head or "trained default",
        "verifications": len(served),
        "served_first_equals_teacher_forced": _share(
            forced.get((i, p), (None,))[0] == draft for i, p, draft, _ in served),
        "served_first_accepted": _share(acc >= 1 for *_, acc in served),
        "teacher_forced_first_at_draft_starts": _share(d == t for d, t in at_starts),
        "teacher_forced_first_at_every_position": _share(d == t for d, t in forced.values()),
        "positions": len(forced)}
    write_report(out_path(args, DEFAULT_OUT), report)
    print(report)
    return report


def _share(flags: Any) -> float:
    values = list(flags)
    return round(sum(values) / max(1, len(values)), 4)


if __name__ == "__main__":
    main()
