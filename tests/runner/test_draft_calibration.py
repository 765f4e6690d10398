"""The priced confidence gate (runner/draft_calibration.py, runner/draft_gate.py): what
a chain's next draft gains is learnt per depth and band of its confidence product from
the drafts verified, a chain goes on only where that gain pays the scheduler's price,
and only a trained head's chains under the goodput policy with no threshold given are
priced."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.draft_calibration import NUM_BANDS, NUM_DEPTHS, DraftCalibration
from runner.draft_gate import ConfidenceGate, gate_priced
from spec_decode import SpeculativeConfig
from spec_decode.price import DraftPrice
from tests.runner.test_draft_gate import ScriptedNet


def _verify(cal: DraftCalibration, chains: dict[str, list[float]],
            verified: dict[str, int], accepted: dict[str, int]) -> None:
    """Remember `chains` as one step's proposals, then verify them the next step."""
    for rid, products in chains.items():
        cal.remember(rid, products)
    ids = list(chains)
    cal.learn(ids, np.array([verified[r] for r in ids]), np.array([accepted[r] for r in ids]),
              np.ones(len(ids), dtype=bool))


def going_on(cal: DraftCalibration, products: list[float], depth: int = 1,
             per_row: float = 0.3, per_pass: float = 0.0) -> list[bool]:
    return cal.going_on(DraftPrice(per_row, per_pass))(np.array(products), depth).tolist()


def test_with_no_record_a_draft_is_worth_its_confidence_squared() -> None:
    """The prior: the next draft as sure as the chain so far, at the band's middle, so
    a fresh gate goes on from the band whose middle squared pays the price (0.45^2 =
    0.2025, 0.35^2 = 0.1225)."""
    cal = DraftCalibration()
    for depth in range(1, NUM_DEPTHS + 2):  # deeper than the last depth: the last's
        assert going_on(cal, [0.35, 0.45, 0.99], depth, per_row=0.2) == [False, True, True]
    assert going_on(cal, [0.0, 0.5], per_row=0.0) == [True, True]
    assert going_on(cal, [0.9, 1.0], per_row=0.99) == [False, False]


def test_a_band_whose_next_drafts_are_rejected_is_written_off() -> None:
    """Chains at c_1 = 0.65 whose second draft is always rejected: after their record,
    a chain goes on past its first draft only from 0.7 up (at a price of 0.3 a row),
    where a learner that counted every verified draft as won would still go on from
    0.3; deeper depths keep their own record."""
    cal = DraftCalibration(decay=1.0)
    for step in range(20):
        _verify(cal, {f"r{step}": [0.65, 0.6]}, {f"r{step}": 2}, {f"r{step}": 1})
    assert going_on(cal, [0.65, 0.75]) == [False, True]
    assert going_on(cal, [0.65, 0.75], depth=2) == [True, True]
    assert cal.gains()[0, 6] == pytest.approx(4 * 0.65**2 / 24)  # the prior weighs 4 chains
    assert cal.seen[0, 6] == 20 and cal.won.sum() == 0
    # A band below one written off goes with it, whatever its own (prior) record: a
    # hole in the middle is noise. A band above that accepts keeps paying.
    assert cal.envelope()[0, :7].max() == pytest.approx(cal.gains()[0, 6])
    for step in range(20):
        _verify(cal, {f"s{step}": [0.85, 0.8]}, {f"s{step}": 2}, {f"s{step}": 2})
    assert going_on(cal, [0.65, 0.85]) == [False, True]
    assert cal.gains()[0, 8] > 0.8


def test_a_pass_goes_ahead_only_for_chains_that_pay_for_it() -> None:
    """Each chain that goes on pays its rows; together they pay the one drafter pass
    they run on, or none goes on. Fresh bands: a chain at 0.75 gains 0.5625, at 0.65
    0.4225, at 0.45 0.2025; a row costs 0.3."""
    cal = DraftCalibration()
    assert going_on(cal, [0.75, 0.65], per_pass=0.35) == [True, True]  # 0.2625 + 0.1225
    assert going_on(cal, [0.75, 0.65], per_pass=0.4) == [False, False]
    assert going_on(cal, [0.65], per_pass=0.1) == [True]
    assert going_on(cal, [0.65], per_pass=0.15) == [False]
    assert going_on(cal, [0.75, 0.45], per_pass=0.2) == [True, False]  # 0.45: not its row


def test_only_verified_drafts_teach_and_each_depth_its_own() -> None:
    cal = DraftCalibration(decay=1.0)
    # Three drafts proposed, two verified (the scheduler cut the third), both accepted:
    # the second draft was won from c_1 = 0.9; nothing is known past it.
    _verify(cal, {"a": [0.9, 0.75, 0.5]}, {"a": 2}, {"a": 2})
    assert cal.seen.sum() == 1 and cal.seen[0, 9] == 1 and cal.won[0, 9] == 1
    # Four verified, one accepted: the second lost from 0.9 (depth 1), the third from
    # 0.75 (depth 2), the fourth from 0.35 (depth 3 and deeper together).
    _verify(cal, {"b": [0.9, 0.75, 0.35, 0.2]}, {"b": 4}, {"b": 1})
    assert cal.seen[0, 9] == 2 and cal.won[0, 9] == 1
    assert cal.seen[1, 7] == 1 and cal.seen[2, 3] == 1 and cal.won[1:].sum() == 0
    # A chain of one draft, or a request verified without a remembered chain, teaches
    # nothing; a request that left is forgotten.
    before = cal.seen.copy()
    _verify(cal, {"c": [0.9]}, {"c": 1}, {"c": 1})
    cal.remember("d", [0.9, 0.8])
    cal.forget("d")
    cal.learn(["d", "e"], np.array([2, 2]), np.array([2, 2]), np.ones(2, dtype=bool))
    assert np.array_equal(cal.seen, before)


def test_a_request_that_did_not_sample_keeps_its_chain_for_later() -> None:
    cal = DraftCalibration(decay=1.0)
    cal.remember("a", [0.9, 0.8])
    cal.learn(["a"], np.array([0]), np.array([0]), np.array([False]))  # a prefill chunk
    cal.learn(["a"], np.array([2]), np.array([2]), np.array([True]))
    assert cal.seen[0, 9] == 1 and cal.won[0, 9] == 1


def test_records_fade_so_a_band_written_off_is_tried_again() -> None:
    cal = DraftCalibration(decay=0.9)
    for step in range(20):
        _verify(cal, {f"r{step}": [0.65, 0.6]}, {f"r{step}": 2}, {f"r{step}": 1})
    assert going_on(cal, [0.65]) == [False]
    for _ in range(60):  # steps with nothing to learn: the record fades
        cal.learn([], np.zeros(0), np.zeros(0), np.zeros(0, dtype=bool))
    assert going_on(cal, [0.65]) == [True]


def test_a_priced_gate_asks_its_chooser_with_each_chains_product_and_depth() -> None:
    """The gate hands the chooser each chain's product so far and its depth, keeps the
    chains it picks, and records every chain's products."""
    asked: list[tuple[list[float], int]] = []

    def chooser(products: np.ndarray, depth: int) -> np.ndarray:
        asked.append((products.round(4).tolist(), depth))
        return products >= 0.3 * depth

    net = ScriptedNet([[0.6, 0.45], [0.5]])
    gate = ConfidenceGate(0.0, priced=chooser)
    hidden = torch.zeros(2, 4)
    gate.drafts(net, hidden, [0, 1])
    assert gate.still_drafting(np.array([0, 1]), 1).tolist() == [0, 1]
    gate.drafts(net, hidden[:1], [0])  # 0.6 * 0.5 = 0.3, under 0.6 at depth 2
    assert gate.still_drafting(np.array([0]), 2).tolist() == []
    assert asked == [([0.6, 0.45], 1), ([0.3], 2)]
    assert gate.products[0] == pytest.approx([0.6, 0.3])
    assert gate.products[1] == pytest.approx([0.45])
    # A gate that records without a threshold weighs and lets every chain go on.
    free = ConfidenceGate(0.0, record=True)
    free.drafts(ScriptedNet([[0.4]]), hidden[:1], [7])
    assert free.still_drafting(np.array([7]), 1).tolist() == [7]
    assert free.products == {7: [pytest.approx(0.4)]}


def test_which_gates_are_priced() -> None:
    def spec(**kw: object) -> SpeculativeConfig:
        got = SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 4,
                                           **kw})
        assert got is not None
        return got

    assert SpeculativeConfig.draft_policy == "goodput"
    assert gate_priced(spec(), trained=True, tree=False)
    assert not gate_priced(spec(), trained=False, tree=False)  # a random head
    assert not gate_priced(spec(), trained=True, tree=True)
    assert not gate_priced(spec(draft_policy="fixed"), trained=True, tree=False)
    assert not gate_priced(spec(min_draft_confidence=0.4), trained=True, tree=False)
    parallel = SpeculativeConfig.from_dict({"method": "parallel", "num_speculative_tokens": 4})
    assert parallel is not None and not gate_priced(parallel, trained=True, tree=False)


def test_bands_cover_the_unit_interval() -> None:
    cal = DraftCalibration()
    assert len(cal.edges) == NUM_BANDS + 1 and cal.edges[0] == 0.0 and cal.edges[-1] == 1.0
    cal.remember("a", [1.0, 1.0])  # a certain draft lands in the top band
    cal.learn(["a"], np.array([2]), np.array([2]), np.array([True]))
    assert cal.seen[0, NUM_BANDS - 1] == 1.0 and cal.won[0, NUM_BANDS - 1] == 1.0


@pytest.mark.model
def test_the_gate_prices_with_what_the_scheduler_priced(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The real engine: a head loaded from a directory (trained, for the engine) under
    the goodput policy prices its gate with every step's `draft_price` and nothing
    else, settles every chain it remembered, and changes no output; under the fixed
    policy, or with a threshold given, it keeps no record."""
    from engine.llm import LLM
    from scheduler import SamplingParams
    from tests.runner.test_eagle3 import write_published_layout
    from tests.server_helpers import default_model

    model = default_model()
    write_published_layout(tmp_path / "head", model, [2, 15, 27])
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def engine(spec: dict | None) -> LLM:
        return LLM(loaded_model=model, num_kv_blocks=32, max_model_len=128,
                   speculative_config=spec)

    off = [o.outputs[0].token_ids for o in engine(None).generate(prompts, params)]
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "head")}
    llm = engine(spec)
    drafter = llm.engine.runner.spec.drafter
    calibration = drafter.calibration
    assert calibration is not None
    told: list[DraftPrice] = []
    used: list[DraftPrice] = []
    execute, going_on = llm.engine.runner.execute, calibration.going_on

    def executed(out):  # type: ignore[no-untyped-def]
        if out.draft_price is not None and out.num_draft_tokens:
            told.append(out.draft_price)
        return execute(out)

    def priced(price: DraftPrice):  # type: ignore[no-untyped-def]
        used.append(price)
        return going_on(price)

    llm.engine.runner.execute = executed
    calibration.going_on = priced  # type: ignore[method-assign]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == off
    assert told and used == told
    assert not calibration._chains  # every chain verified or forgotten
    for other in ({**spec, "draft_policy": "fixed"}, {**spec, "min_draft_confidence": 0.3}):
        assert engine(other).engine.runner.spec.drafter.calibration is None
