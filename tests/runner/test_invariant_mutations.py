"""Mutation tests: a scheduler broken on purpose must be refused, by the real runner and
by the simulated one, with BudgetInvariantError before either writes a buffer or any
request state (DESIGN.md §2). And a runner whose own pass assembly is
broken must be refused too: its count comes from the rows it assembles, not from the
cost table the scheduler charged from.

Each case breaks exactly one thing through the method's own class (the cost table the
scheduler charges from, or the recipe the runners assemble from), so the same break
reaches both runners.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import scheduler.budget as budget
from engine.llm import LLM
from runner import BudgetInvariantError
from runner.simulated import SimulatedRunner
from scheduler import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.budget import ThrottleRule
from spec_decode import SpeculativeConfig
from spec_decode.methods import PassRecipe, SpecMethod, get_method
from tests.helpers import spec_dict
from tests.server_helpers import default_model

pytestmark = pytest.mark.model  # loads the real default model

B, K, MAX_MODEL_LEN, BLOCK = 64, 4, 128, 16
RUNNERS = ("model", "simulated")


def build(kind: str, method: str, rule: Callable[[Scheduler], ThrottleRule] | None = None
          ) -> tuple[Scheduler, Any]:
    """A scheduler and a runner of `kind` sharing its limits."""
    spec = spec_dict(method, K, draft_policy="fixed")  # K drafts: what each mutation breaks
    if kind == "model":
        core = LLM(loaded_model=default_model(), max_num_batched_tokens=B, num_kv_blocks=32,
                   max_model_len=MAX_MODEL_LEN, block_size=BLOCK,
                   speculative_config=spec).engine
        sched = core.scheduler
        runner: Any = core.runner
    else:
        sched = Scheduler(SchedulerConfig(B, 8, MAX_MODEL_LEN),
                          CacheConfig(block_size=BLOCK, num_blocks=32),
                          SpeculativeConfig.from_dict(spec))
        runner = SimulatedRunner(sched)
    if rule is not None:
        sched.rule = rule(sched)
    return sched, runner


def snapshot(runner: Any) -> Any:
    if isinstance(runner, SimulatedRunner):
        return copy.deepcopy(runner.reqs)
    states = runner.states
    return (dict(states.row_of), states.num_computed.copy(), states.num_tokens.copy(),
            states.token_ids.copy(), states.block_table.copy(), states.num_blocks.copy())


def assert_refused_untouched(runner: Any, out: Any, match: str) -> None:
    """`runner.execute(out)` raises, and no buffer or request state moved."""
    model = not isinstance(runner, SimulatedRunner)
    if model:
        for buf in (runner.buffers.input_ids, runner.buffers.positions,
                    runner.buffers.slot_mapping):
            buf.np[:] = -7
    before = snapshot(runner)
    with pytest.raises(BudgetInvariantError, match=match):
        runner.execute(out)
    after = snapshot(runner)
    if model:
        for buf in (runner.buffers.input_ids, runner.buffers.positions,
                    runner.buffers.slot_mapping):
            assert (buf.np == -7).all()
        assert after[0] == before[0]
        for old, new in zip(before[1:], after[1:], strict=True):
            assert np.array_equal(old, new)
    else:
        assert after == before


def first_step(kind: str, method: str, prompt_len: int, max_tokens: int = 50,
               rule: Callable[[Scheduler], ThrottleRule] | None = None) -> tuple[Any, Any]:
    sched, runner = build(kind, method, rule)
    sched.add_request(Request("r", [100 + i for i in range(prompt_len)],
                              SamplingParams(max_tokens=max_tokens)))
    sched.add_request(Request("q", [300 + i for i in range(8)], SamplingParams(max_tokens=50)))
    return sched.schedule(), runner


@pytest.mark.parametrize("kind", RUNNERS)
def test_honest_steps_run(kind: str) -> None:
    """The baseline every mutation departs from: unbroken, the same step runs."""
    for method in ("pard", "dflash"):
        out, runner = first_step(kind, method, 12)
        result = runner.execute(out)
        assert result.pass_rows == {**out.pass_rows, **result.pass_rows}


@pytest.mark.parametrize("kind", RUNNERS)
def test_k_above_the_rule(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler that ignores the cuts (max_tokens 4 allows k = 2) and charges K."""
    monkeypatch.setattr(budget, "k_rule", lambda max_k, *args: max_k)
    out, runner = first_step(kind, "pard", 12, max_tokens=4)
    assert out.num_draft_tokens["r"] == K  # the broken scheduler's own, consistent charge
    assert_refused_untouched(runner, out, r"'r' was declared k=4 drafts but the k rule "
                                          r"allows 2")


class DraftsOnEveryChunk(ThrottleRule):
    """Broken on purpose: proposes K drafts whether the chunk samples or not."""

    def plan(self, n: int, num_spec: int, k: int, behind: int = 0,
             samples: bool = True) -> budget.ChunkPlan:
        return super().plan(n, num_spec, self.max_k, behind, samples)


@pytest.mark.parametrize("kind", RUNNERS)
def test_k_on_a_chunk_that_does_not_sample(kind: str) -> None:
    def broken(sched: Scheduler) -> ThrottleRule:
        return DraftsOnEveryChunk(sched.method, K, MAX_MODEL_LEN)

    out, runner = first_step(kind, "pard", 100, rule=broken)  # 100 > B: a partial chunk
    assert out.num_scheduled_tokens["r"] < 100 and out.num_draft_tokens["r"] == K
    assert_refused_untouched(runner, out, r"'r' was declared k=4 drafts but the k rule "
                                          r"allows 0")


@pytest.mark.parametrize("kind", RUNNERS)
@pytest.mark.parametrize(("method", "extra", "pass_name"), [
    ("pard", lambda k: (k - 1,), "draft"),  # one row short per drafting request
    ("pard", lambda k: (k + 1,), "draft"),  # one row over
    ("parallel", lambda k: (k,), "draft"),
    ("draft_model", lambda k: (0,), "draft"),
    ("dflash", lambda k: (0, k), "query"),  # the query block charged k, not k + 1
])
def test_cost_table_off_by_one(kind: str, method: str, extra: Callable[[int], tuple],
                               pass_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler charges from a broken cost table; the runner assembles the true
    rows from the recipe and refuses the step."""
    out, runner = first_step(kind, method, 12)
    honest = dict(out.pass_rows)
    monkeypatch.setattr(type(get_method(method)), "extra_rows",
                        lambda self, k: extra(k) if k else (0,) * len(self.recipes))
    out, runner = first_step(kind, method, 12)
    assert out.pass_rows[pass_name] != honest[pass_name]
    assert_refused_untouched(runner, out, rf"pass '{pass_name}' built {honest[pass_name]} "
                                          rf"rows but the scheduler charged "
                                          rf"{out.pass_rows[pass_name]}")


@pytest.mark.parametrize("kind", RUNNERS)
def test_dflash_query_charged_k_even_where_context_is_widest(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Here the context pass (12 + 8 rows) is the widest, so comparing only the widest
    pass with num_drafter_tokens could not see the short query charge."""
    monkeypatch.setattr(type(get_method("dflash")), "extra_rows",
                        lambda self, k: (0, k) if k else (0, 0))
    out, runner = first_step(kind, "dflash", 12)
    assert out.num_drafter_tokens == out.pass_rows["context"] > out.pass_rows["query"]
    assert_refused_untouched(runner, out, r"pass 'query' built 10 rows but the scheduler "
                                          r"charged 8")


@pytest.mark.parametrize("kind", RUNNERS)
def test_runner_recipe_one_row_short(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side: the runner's own assembly is broken (pard one mask row short);
    its count comes from what it assembles, so it no longer matches the charge."""
    cls = type(get_method("pard"))
    recipe = dataclasses.replace(cls.recipes[0], masks=-2)
    monkeypatch.setattr(cls, "recipes", (recipe,))
    out, runner = first_step(kind, "pard", 12)
    assert_refused_untouched(runner, out, r"pass 'draft' built 26 rows but the scheduler "
                                          r"charged 28")


@pytest.mark.parametrize("kind", RUNNERS)
def test_lookahead_one_slot_short(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler holds one KV slot too few for pard's mask rows: with a 13-token
    prompt the last mask row (position 16) would land in a block it never got."""
    monkeypatch.setattr(type(get_method("pard")), "lookahead_slots", lambda self, k: k - 1)
    out, runner = first_step(kind, "pard", 13)
    assert_refused_untouched(runner, out, r"pass 'draft' would write position 16 of "
                                          r"request 'r', which holds 16 slots")


@pytest.mark.parametrize("kind", RUNNERS)
def test_recipe_reading_past_its_slice(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recipe that reads its drafts one row late would read the next request's first
    row: refused once the pass is filled, before the drafter runs it."""
    cls = type(get_method("pard"))
    monkeypatch.setattr(cls, "recipes", (dataclasses.replace(cls.recipes[0], read_skip=1),))
    out, runner = first_step(kind, "pard", 12)
    with pytest.raises(BudgetInvariantError, match="reads drafts from rows outside"):
        runner.execute(out)


def test_every_method_assembles_its_cost_table() -> None:
    """The two descriptions each method carries agree on every (n, k): what the
    scheduler charges is what the runners assemble."""
    from spec_decode import METHODS
    from spec_decode.passes import assemble_rows

    n = np.array([1, 1, 5, 7, 3, 9])
    k = np.array([0, 1, 4, 0, 2, 3])
    for name in METHODS:
        method = get_method(name)
        assembled = {rows.name: rows.rows.tolist() for rows in assemble_rows(method, n, k)}
        charged = {pass_name: [method.rows(int(a), int(b))[i] for a, b in zip(n, k)]
                   for i, pass_name in enumerate(method.pass_names)}
        assert assembled == charged, name


def test_recipe_masks_are_what_the_design_table_says() -> None:
    assert get_method("dflash").recipes[1] == PassRecipe(
        "query", context=False, bonus=True, masks=0, reads="all", read_skip=1)


class EchoMethod(SpecMethod):
    """A method defined outside the package, as a user's one new file would: a head
    pass of the context plus k + 1 query-like rows in a second pass."""

    name = "echo_test"
    drafter = "head"
    recipes = (PassRecipe("draft", shift=1, conditioned=True),
               PassRecipe("block", context=False, bonus=True, masks=0, reads="all",
                          read_skip=1))

    def extra_rows(self, k: int) -> tuple[int, ...]:
        return (0, k + 1 if k else 0)

    def lookahead_slots(self, k: int) -> int:
        return k + 1 if k else 0


def test_a_new_method_is_one_class() -> None:
    """Registering one class is all the scheduler and the runners need: the config
    accepts it, B is checked against its cost, the scheduler charges it and the
    simulated runner assembles, bounds and checks its passes for a whole run."""
    from spec_decode import methods
    from tests.helpers import drain, make_request, make_scheduler

    with methods.registered(EchoMethod):
        with pytest.raises(ValueError, match=r"'draft': 5, 'block': 5"):
            make_scheduler(EchoMethod.name, k=4, budget=4)
        sched = make_scheduler(EchoMethod.name, k=4, budget=32, max_model_len=64)
        runner = SimulatedRunner(sched, acceptance=0.7)
        for i in range(6):
            sched.add_request(make_request(f"r{i}", 10 + 7 * i, max_tokens=30))
        out = sched.schedule()
        assert set(out.pass_rows) == {"target", "draft", "block"}
        sched.update_from_output(out, runner.execute(out))
        drain(sched, runner)
        assert runner.last_step is not None and runner.last_step.max_position() < 64
    assert EchoMethod.name not in methods.method_names()  # gone after the block


def second_step(kind: str, method: str) -> tuple[Scheduler, Any]:
    """A scheduler and runner after one honest step (both requests drafting K)."""
    sched, runner = build(kind, method)
    sched.add_request(Request("r", [100 + i for i in range(12)], SamplingParams(max_tokens=50)))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    return sched, runner


@pytest.mark.parametrize("kind", RUNNERS)
def test_a_scheduler_whose_drafter_lag_drifted_is_refused(kind: str) -> None:
    """Broken on purpose: the scheduler believes r's drafter is 2 positions behind (it
    is level), so it charges 2 catch-up rows the runner, counting its own lag, never
    builds. Parking's charge is not checked against a copy of itself."""
    sched, runner = second_step(kind, "dflash")
    sched.requests["r"].num_drafter_computed -= 2
    out = sched.schedule()
    assert_refused_untouched(runner, out, r"pass 'context' built \d+ rows but the "
                                          r"scheduler charged \d+")


@pytest.mark.parametrize("kind", RUNNERS)
def test_a_runner_whose_drafter_is_ahead_is_refused(kind: str) -> None:
    """Broken on purpose: the runner's own count puts r's drafter past its target."""
    sched, runner = second_step(kind, "eagle")
    if isinstance(runner, SimulatedRunner):
        runner.reqs["r"].num_drafter_computed += 3
    else:
        runner.states.num_drafter_computed[runner.states.row_of["r"]] += 3
    out = sched.schedule()
    with pytest.raises(BudgetInvariantError, match=r"'r''s drafter is 3 positions ahead"):
        runner.execute(out)
