"""`fill_pass` and `plan_step_rows` on worked examples, each array written out by hand."""

from __future__ import annotations

import numpy as np

from spec_decode.methods import PassRecipe, get_method
from spec_decode.passes import MASK_ROW, PassRows, StepResult, fill_pass, plan_step_rows

MASK = 7  # the mask token id
A = np.array


def result(c: list[int], n: list[int], valid: list[int], k: list[int]) -> StepResult:
    """Requests in state rows 0, 1, ...; their target-pass rows start at cumsum(n)."""
    num = A(n)
    return StepResult(rows=np.arange(len(c)), computed=A(c), num_scheduled=num,
                      q_start=np.cumsum(num) - num, valid=A(valid),
                      samples=np.ones(len(c), dtype=bool), num_draft_tokens=A(k))


def token_table(length: int = 16) -> np.ndarray:
    """Request r's token at position p is 100 r + p: every id says where it came from."""
    return 100 * np.arange(2)[:, None] + np.arange(length)[None, :]


def test_the_docstring_example() -> None:
    """rows [3, 2], real [2, 2], masks [1, 0], starts [5, 0]."""
    recipe = PassRecipe("p", conditioned=True, reads="all")
    rows = PassRows(recipe, context=A([2, 2]), bonus=A([0, 0]), masks=A([1, 0]))
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
