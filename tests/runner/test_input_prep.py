"""`prepare_inputs` on its docstring's worked example, every buffer written out by hand."""

from __future__ import annotations

import numpy as np
import torch

from runner.buffers import StepBuffers
from runner.input_prep import prepare_inputs, write_spec_tokens
from runner.request_states import RequestStates
from scheduler import NewRequestData, SamplingParams
from spec_decode.tree_shape import TreeShape

BLOCK = 4


def states_with(requests: list[tuple[str, int, int, list[int]]]) -> RequestStates:
    """(id, known tokens, computed, block ids); request r's token at p is 100 r + p."""
    states = RequestStates(max_num_seqs=4, max_model_len=32, max_blocks_per_req=8,
                           device=torch.device("cpu"))
    for r, (rid, known, computed, blocks) in enumerate(requests):
        states.add(NewRequestData(rid, [100 * r + p for p in range(known)], [],
                                  SamplingParams(max_tokens=4), blocks, computed))
    return states


def test_the_docstring_example() -> None:
    """num_scheduled [2, 5, 3], computed [10, 0, 7]: a (12 known) decodes after
    verifying 1 draft, b is a prefill piece (5 of 9), c finishes its prompt (10)."""
    states = states_with([("a", 11, 10, [3, 1, 4, 5]), ("b", 9, 0, [9, 2, 6]),
                          ("c", 10, 7, [8, 0, 7])])
    write_spec_tokens(states, {"a": [55]})  # a's draft sits at position 11
    buffers = StepBuffers(16, 4, 8, torch.device("cpu"))
    step = prepare_inputs(states, buffers, ["a", "b", "c"], np.array([2, 5, 3]),
                          np.array([1, 0, 0]), BLOCK)
    total = step.num_tokens
    assert total == 10
    assert buffers.positions.np[:total].tolist() == [10, 11, 0, 1, 2, 3, 4, 7, 8, 9]
    assert buffers.input_ids.np[:total].tolist() == [10, 55, 100, 101, 102, 103, 104,
                                                     207, 208, 209]
    # slot = block_table[req, pos // 4] * 4 + pos % 4: a's 10, 11 in its block 2 (id
    # 4), c's 7 in its block 1 (id 0), its 8, 9 in block 2 (id 7).
    assert buffers.slot_mapping.np[:total].tolist() == [18, 19, 36, 37, 38, 39, 8,
                                                        3, 28, 29]
    assert buffers.query_start_loc.np[:4].tolist() == [0, 2, 7, 10]
    assert buffers.seq_lens.np[:3].tolist() == [12, 5, 10]
    # a reads logits at its last 1 + s = 2 rows; b does not sample; c at its last row.
    assert step.samples.tolist() == [True, False, True]
    assert step.num_logits == 3
    assert buffers.logits_indices.np[:3].tolist() == [0, 1, 9]
    assert (step.max_query_len, step.max_seq_len) == (5, 12)
    assert buffers.block_table.np[1, :3].tolist() == [9, 2, 6]


def test_no_requests_is_an_empty_step() -> None:
    states = states_with([])
    buffers = StepBuffers(16, 4, 8, torch.device("cpu"))
    step = prepare_inputs(states, buffers, [], np.zeros(0, dtype=np.int64),
                          np.zeros(0, dtype=np.int64), BLOCK)
    assert (step.num_tokens, step.num_logits, step.max_query_len) == (0, 0, 0)


def test_a_draft_tree_s_rows() -> None:
    """a verifies a tree of five drafts [a1 b1 a2 b2 a3] (T = 2) from position 10 after
    its token at 9; c decodes alone. a's rows: t0 a1 a2 a3 then the leaves b1 b2, each
    at its chain draft's position, seeing the keys before it; the logits rows
    verification reads are t0 and the chain's, and the leaves' rows are listed after
    every request's (computed with them where they fit the LM head's call)."""
    states = states_with([("a", 10, 9, [3, 1, 4, 5]), ("c", 10, 9, [8, 0, 7])])
    write_spec_tokens(states, {"a": [51, 61, 52, 62, 53]}, TreeShape((2,), 8))
    assert states.token_ids[0, 10:15].tolist() == [51, 52, 53, 61, 62]
    buffers = StepBuffers(16, 4, 8, torch.device("cpu"))
    step = prepare_inputs(states, buffers, ["a", "c"], np.array([6, 1]),
                          np.array([5, 0]), BLOCK, TreeShape((2,), 8))
    total = step.num_tokens
    assert buffers.input_ids.np[:total].tolist() == [9, 51, 52, 53, 61, 62, 109]
    assert buffers.positions.np[:total].tolist() == [9, 10, 11, 12, 10, 11, 9]
    assert buffers.tree_prefix.np[:total].tolist() == [-1, -1, -1, -1, 10, 11, -1]
    # Slots follow the rows, leaves included: a's positions 9..14 in its blocks 2, 3
    # (ids 4, 5).
    assert buffers.slot_mapping.np[:6].tolist() == [17, 18, 19, 20, 21, 22]
    assert step.has_leaves and step.num_chain.tolist() == [3, 0]
    assert buffers.logits_indices.np[:step.num_logits].tolist() == [0, 1, 2, 3, 6]
    assert step.num_leaf_logits == 2
    assert buffers.logits_indices.np[step.num_logits:][:2].tolist() == [4, 5]


def test_a_chain_has_no_tree_rows() -> None:
    states = states_with([("a", 10, 9, [3, 1, 4, 5])])
    write_spec_tokens(states, {"a": [51, 52]})
    buffers = StepBuffers(16, 4, 8, torch.device("cpu"))
    step = prepare_inputs(states, buffers, ["a"], np.array([3]), np.array([2]), BLOCK)
    assert not step.has_leaves and step.num_leaf_logits == 0
    assert buffers.positions.np[:3].tolist() == [9, 10, 11]
    assert buffers.logits_indices.np[:3].tolist() == [0, 1, 2]
