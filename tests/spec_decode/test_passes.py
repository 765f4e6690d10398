"""`fill_pass` and `plan_step_rows` on worked examples, each array written out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from runner import BudgetInvariantError
from runner.invariant import check_filled
from spec_decode.methods import PassRecipe, get_method
from spec_decode.passes import (
    MASK_ROW,
    DraftPass,
    PassRows,
    StepResult,
    fill_pass,
    plan_step_rows,
)

MASK = 7  # the mask token id
A = np.array


def result(c: list[int], n: list[int], valid: list[int], k: list[int],
           catch_up: list[int] | None = None) -> StepResult:
    """Requests in state rows 0, 1, ...; their target-pass rows start at cumsum(n)."""
    num = A(n)
    return StepResult(rows=np.arange(len(c)), computed=A(c), num_scheduled=num,
                      q_start=np.cumsum(num) - num, valid=A(valid),
                      samples=np.ones(len(c), dtype=bool), num_draft_tokens=A(k),
                      catch_up=A(catch_up) if catch_up else np.zeros(len(c), dtype=np.int64))


def token_table(length: int = 16) -> np.ndarray:
    """Request r's token at position p is 100 r + p: every id says where it came from."""
    return 100 * np.arange(2)[:, None] + np.arange(length)[None, :]


def test_the_docstring_example() -> None:
    """rows [3, 2], real [2, 2], masks [1, 0], starts [5, 0]."""
    recipe = PassRecipe("p", conditioned=True, reads="all")
    rows = PassRows(recipe, context=A([2, 2]), bonus=A([0, 0]), masks=A([1, 0]),
                    reads=A([1, 0]))
    out = fill_pass(rows, result(c=[5, 0], n=[2, 2], valid=[2, 2], k=[1, 0]), token_table(),
                    MASK)
    assert out.req_index.tolist() == [0, 0, 0, 1, 1]
    assert out.positions.tolist() == [5, 6, 7, 0, 1]
    assert out.token_ids.tolist() == [5, 6, MASK, 100, 101]
    # Token rows read the target's row at their position (request 1's start at row 2).
    assert out.hidden_src.tolist() == [0, 1, MASK_ROW, 2, 3]
    # One draft, read where the bonus token's row is, c + L = 7: row 2.
    assert out.readout.tolist() == [2] and out.reads_per_req.tolist() == [1, 0]
    assert out.slice_starts.tolist() == [0, 3]


def test_parallel_after_a_rejection_pads_at_the_end() -> None:
    """c = 10, n = 3 (the last token and 2 drafts), none accepted: L = 1, k = 3.
    Shifted: the row at 10 carries the token at 11 (the new bonus token); then k - 1
    masks; the 2 rejected positions become padding at the end."""
    method = get_method("parallel")
    (rows,) = plan_step_rows(method, A([3]), A([3])).passes
    assert rows.rows.tolist() == [5]
    out = fill_pass(rows, result(c=[10], n=[3], valid=[1], k=[3]), token_table(), MASK)
    assert out.positions.tolist() == [10, 11, 12, 13, 14]
    assert out.token_ids.tolist() == [11, MASK, MASK, 0, 0]
    assert out.hidden_src.tolist() == [0, MASK_ROW, MASK_ROW, MASK_ROW, MASK_ROW]
    assert out.readout.tolist() == [0, 1, 2]  # the bonus row's output, then each mask's


def test_dflash_query_block_starts_at_the_bonus_position() -> None:
    """c = 10, n = 3, L = 1, k = 2: the query pass has no context rows; it starts at
    c + L = 11 with the bonus token (unshifted), then k masks, and reads past the bonus."""
    method = get_method("dflash")
    context, query = plan_step_rows(method, A([3]), A([2])).passes
    assert (context.rows.tolist(), query.rows.tolist()) == ([3], [3])
    res = result(c=[10], n=[3], valid=[1], k=[2])
    out = fill_pass(query, res, token_table(), MASK)
    assert out.positions.tolist() == [11, 12, 13] and out.starts.tolist() == [11]
    assert out.token_ids.tolist() == [11, MASK, MASK]
    assert out.hidden_src.tolist() == [MASK_ROW] * 3  # the query block is not conditioned
    assert out.readout.tolist() == [1, 2]
    ctx = fill_pass(context, res, token_table(), MASK)
    assert ctx.token_ids.tolist() == [10, 0, 0] and ctx.hidden_src.tolist() == [0, -1, -1]
    assert ctx.readout.tolist() == []


def test_a_request_that_does_not_draft_gets_context_rows_only() -> None:
    """k = 0 (a prefill piece): no bonus, no masks, nothing read."""
    method = get_method("dflash")
    context, query = plan_step_rows(method, A([4, 1]), A([0, 2])).passes
    assert context.rows.tolist() == [4, 1] and query.rows.tolist() == [0, 3]
    out = fill_pass(query, result(c=[0, 6], n=[4, 1], valid=[4, 1], k=[0, 2]),
                    token_table(), MASK)
    assert out.req_index.tolist() == [1, 1, 1] and out.positions.tolist() == [7, 8, 9]
    assert out.token_ids.tolist() == [107, MASK, MASK]
    assert out.reads_per_req.tolist() == [0, 2]


def test_plan_step_rows_counts_every_pass_and_the_one_row_steps() -> None:
    """eagle: one pass of n rows, then k - 1 one-row steps for each drafting request."""
    step = plan_step_rows(get_method("eagle"), A([3, 1, 5]), A([4, 2, 0]))
    assert step.counts == {"target": 9, "draft": 9, "step_1": 2, "step_2": 1, "step_3": 1}
    assert plan_step_rows(None, A([3, 1]), A([0, 0])).counts == {"target": 4}


def test_a_parked_request_has_no_context_rows() -> None:
    """dflash, both decoding: request 0 samples with k = 0 (parked: no rows in any
    pass, its 2 rows of lag kept for later); request 1 drafts 2 level with its target.
    A prefill piece (not sampling) with k = 0 keeps its context rows."""
    method = get_method("dflash")
    step = plan_step_rows(method, A([1, 1, 4]), A([0, 2, 0]), behind=A([2, 0, 0]),
                          samples=A([True, True, False]))
    context, query = step.passes
    assert context.rows.tolist() == [0, 1, 4] and query.rows.tolist() == [0, 3, 0]
    assert step.parked is not None and step.parked.tolist() == [True, False, False]
    assert step.catch_up is not None and step.catch_up.tolist() == [0, 0, 0]
    # Without the runner's counts nobody parks (the layout tests above).
    assert plan_step_rows(method, A([1]), A([0])).passes[0].rows.tolist() == [1]


def test_a_request_drafting_again_catches_up_from_the_feature_cache() -> None:
    """dflash, c = 10, its drafter 3 behind (parked for 3 steps), n = 2, L = 1, k = 2:
    the context segment starts at c - 3 = 7 with 3 catch-up rows that read the cached
    features at their own positions, then the chunk's real row from this step's target
    pass, then the rejected position as padding."""
    method = get_method("dflash")
    step = plan_step_rows(method, A([2]), A([2]), behind=A([3]), samples=A([True]))
    context, query = step.passes
    assert context.rows.tolist() == [5] and query.rows.tolist() == [3]
    assert step.catch_up is not None and step.catch_up.tolist() == [3]
    res = result(c=[10], n=[2], valid=[1], k=[2], catch_up=[3])
    out = fill_pass(context, res, token_table(), MASK)
    assert out.positions.tolist() == [7, 8, 9, 10, 11] and out.starts.tolist() == [7]
    assert out.token_ids.tolist() == [7, 8, 9, 10, 0]
    assert out.cached.tolist() == [True, True, True, False, False]
    assert out.hidden_src.tolist() == [MASK_ROW] * 3 + [0, MASK_ROW]
    # The query block is where it was: at c + L.
    assert fill_pass(query, res, token_table(), MASK).positions.tolist() == [11, 12, 13]


def test_eagle_catch_up_rows_are_shifted_and_it_reads_past_them() -> None:
    """eagle, c = 10, 2 behind, n = 1, L = 1, k = 2: rows at 8, 9 carry the tokens at
    9, 10 (shifted) from the cache; the row at 10 carries the new bonus token (11) and
    is the one read, 2 rows into the slice."""
    method = get_method("eagle")
    (draft,) = plan_step_rows(method, A([1]), A([2]), behind=A([2]),
                              samples=A([True])).passes
    out = fill_pass(draft, result(c=[10], n=[1], valid=[1], k=[2], catch_up=[2]),
                    token_table(), MASK)
    assert out.positions.tolist() == [8, 9, 10] and out.token_ids.tolist() == [9, 10, 11]
    assert out.cached.tolist() == [True, True, False] and out.readout.tolist() == [2]


def test_a_catch_up_row_reading_an_uncomputed_position_is_refused() -> None:
    """Broken on purpose: a catch-up row at c (this step's chunk, whose features are
    not cached yet) must be refused before the drafter reads the cache."""
    method = get_method("dflash")
    context, _ = plan_step_rows(method, A([2]), A([2]), behind=A([3]),
                                samples=A([True])).passes
    res = result(c=[10], n=[2], valid=[1], k=[2], catch_up=[3])
    out = fill_pass(context, res, token_table(), MASK)
    check_filled("dflash", out, res.q_start, res.num_scheduled, res.computed)  # honest
    out.cached[3], out.hidden_src[3] = True, MASK_ROW  # the row at position 10 = c
    with pytest.raises(BudgetInvariantError, match="cached target features at positions"):
        check_filled("dflash", out, res.q_start, res.num_scheduled, res.computed)


def draft_pass(positions: list[int], rows_per_req: list[int], readout: list[int],
               reads_per_req: list[int]) -> DraftPass:
    rows = len(positions)
    req = np.repeat(np.arange(len(rows_per_req)), rows_per_req)
    return DraftPass("p", req, A(positions), np.zeros(rows, dtype=np.int64),
                     np.zeros(rows, dtype=np.int64), A(rows_per_req),
                     A([positions[s] for s in np.cumsum(rows_per_req) - rows_per_req]),
                     A(readout, dtype=np.int64), A(reads_per_req),
                     np.zeros(rows, dtype=bool))


def test_readout_block_ends_each_sequence_at_its_last_readout() -> None:
    # Request 0: a prompt chunk at 10..14, the last row read out. Request 1: rows at
    # 3..7, the real token and two mask rows at 3..5 read out, padding at 6, 7 after.
    got = draft_pass([10, 11, 12, 13, 14, 3, 4, 5, 6, 7], [5, 5], [4, 5, 6, 7],
                     [1, 3]).readout_block()
    assert got is not None
    assert got.reqs.tolist() == [0, 1] and got.per_req.tolist() == [1, 3]
    assert got.seq_lens.tolist() == [15, 6]
    # A request that reads out nothing here stays out.
    got = draft_pass([10, 11, 3, 4], [2, 2], [3], [0, 1]).readout_block()
    assert got is not None and got.reqs.tolist() == [1] and got.seq_lens.tolist() == [5]


def test_readout_block_refuses_rows_that_are_not_one_block() -> None:
    # Readout rows at positions 3 and 5 with 4 between them unread: as a block of two
    # ending at 5, the first would sit at 4 and see a key it must not.
    assert draft_pass([3, 4, 5], [3], [0, 2], [2]).readout_block() is None
    assert draft_pass([3, 4], [2], [], [0]).readout_block() is None


def test_without_padding_keeps_every_row_a_drafter_reads_and_drops_the_rest() -> None:
    """Eagle, two requests: request 0 verified 4 drafts and kept 1 (c = 10, n = 5,
    L = 2: two padding rows past its bonus row), request 1 a prompt chunk of 3 that
    does not draft (no padding)."""
    method = get_method("eagle")
    (rows,) = plan_step_rows(method, A([5, 3]), A([4, 0])).passes
    res = result(c=[10, 0], n=[5, 3], valid=[2, 3], k=[4, 0])
    res.samples[1] = False
    full = fill_pass(rows, res, token_table(), MASK)
    check_filled("eagle", full, res.q_start, res.num_scheduled, res.computed)
    run = full.without_padding()
    assert full.num_rows == 8 and full.unpadded is not None
    assert full.unpadded.tolist() == [2, 3] and run.rows_per_req.tolist() == [2, 3]
    kept = [0, 1, 5, 6, 7]  # request 0: rows at 10, 11 (tokens 11, 12: the bonus); request 1
    for name in ("req_index", "positions", "token_ids", "hidden_src", "cached"):
        assert getattr(run, name).tolist() == getattr(full, name)[kept].tolist(), name
    assert run.slice_starts.tolist() == [0, 2] and run.starts.tolist() == full.starts.tolist()
    # The same rows read out, renumbered: request 0's bonus row.
    assert full.readout.tolist() == [1] and run.readout.tolist() == [1]
    assert run.token_ids[run.readout].tolist() == full.token_ids[full.readout].tolist()
    check_filled("eagle", run, res.q_start, res.num_scheduled, res.computed)
    blocks = run.readout_block(), full.readout_block()
    assert blocks[0] is not None and blocks[1] is not None
    assert blocks[0].seq_lens.tolist() == blocks[1].seq_lens.tolist() == [12]
    assert run.without_padding() is run


def test_without_padding_renumbers_the_reads_of_later_requests() -> None:
    """Parallel after rejections: each request's padding sits after its masks, and a
    later request's reads move up by the padding dropped before it."""
    method = get_method("parallel")
    (rows,) = plan_step_rows(method, A([3, 3]), A([3, 3])).passes
    res = result(c=[10, 4], n=[3, 3], valid=[1, 2], k=[3, 3])
    full = fill_pass(rows, res, token_table(), MASK)
    run = full.without_padding()
    assert full.rows_per_req.tolist() == [5, 5] and run.rows_per_req.tolist() == [3, 4]
    assert run.positions.tolist() == [10, 11, 12, 4, 5, 6, 7]
    assert full.readout.tolist() == [0, 1, 2, 6, 7, 8]
    assert run.readout.tolist() == [0, 1, 2, 4, 5, 6]
    assert (run.token_ids[run.readout].tolist() == full.token_ids[full.readout].tolist()
            == [11, MASK, MASK, 106, MASK, MASK])
    # A pass with nothing rejected has no padding: the same object back.
    whole = fill_pass(rows, result(c=[10, 4], n=[3, 3], valid=[3, 3], k=[3, 3]),
                      token_table(), MASK)
    assert whole.without_padding() is whole
