"""Fill the step buffers from a SchedulerOutput with vectorised numpy (no per-token loops)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runner.buffers import StepBuffers
from runner.draft_tree import tree_positions
from runner.request_states import RequestStates
from spec_decode.tree_shape import TreeShape


@dataclass
class PreparedStep:
    """What input preparation learned, in scheduled order (one entry per request)."""

    req_ids: list[str]
    rows: np.ndarray  # [num_reqs] state rows
    num_scheduled: np.ndarray  # [num_reqs]
    num_tokens: int  # total rows of the target pass
    samples: np.ndarray  # [num_reqs] bool: the chunk reaches a sampling position
    num_spec: np.ndarray  # [num_reqs] drafts verified
    num_logits: int  # rows of logits verification reads (1 + s per sampling request)
    max_query_len: int
    max_seq_len: int
    # [num_reqs] drafts verified in the chain (s but for a tree's leaves: draft_tree.py)
    num_chain: np.ndarray
    has_leaves: bool  # some row is a tree's leaf (AttentionMetadata.tree_prefix)
    # Leaf rows of sampling requests, listed in `logits_indices` after the num_logits
    # rows verification reads (their logits are wanted only where a leaf is matched).
    num_leaf_logits: int


def write_spec_tokens(states: RequestStates, spec: dict[str, list[int]],
                      shape: TreeShape | None = None) -> None:
    """Drafts to verify sit right after the known tokens, where the chunk reads them:
    a tree's chain first, then its leaves (runner/draft_tree.py)."""
    for req_id, drafts in spec.items():
        row = states.row_of[req_id]
        start = states.num_tokens[row]
        states.token_ids[row, start:start + len(drafts)] = (
            drafts if shape is None else shape.row_order(drafts))


def prepare_inputs(states: RequestStates, buffers: StepBuffers, req_ids: list[str],
                   num_scheduled: np.ndarray, num_spec: np.ndarray,
                   block_size: int, shape: TreeShape | None = None) -> PreparedStep:
    """Positions, token ids, slots, query starts, sequence lengths and logits rows;
    with a tree `shape`, each draft tree's leaf positions and prefixes (draft_tree.py).

    Worked example: num_scheduled [2, 5, 3], computed [10, 0, 7]:
      cu_num       = [2, 7, 10]
      req_index    = [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]      # np.repeat(arange, n)
      offsets      = [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]      # arange - repeat(starts)
      positions    = [10, 11, 0, 1, 2, 3, 4, 7, 8, 9]    # computed[req] + offsets
    """
    rows = np.fromiter((states.row_of[r] for r in req_ids), dtype=np.int64,
                       count=len(req_ids))
    num_reqs = len(req_ids)
    cu_num = np.cumsum(num_scheduled)
    total = int(cu_num[-1]) if num_reqs else 0
    starts = cu_num - num_scheduled
    req_index = np.repeat(np.arange(num_reqs), num_scheduled)
    offsets = np.arange(total) - np.repeat(starts, num_scheduled)
    computed = states.num_computed[rows]
    positions = computed[req_index] + offsets  # each row's place in its sequence
    token_rows = rows[req_index]

    buffers.positions.np[:total] = positions
    buffers.input_ids.np[:total] = states.token_ids[token_rows, positions]
    chain, leaves = num_spec, None  # [total] bool: a tree's leaf rows
    if shape is not None and not shape.is_chain and num_spec.any():
        chain = shape.depth(num_spec)
        draft_index = offsets - (num_scheduled - num_spec)[req_index]
        moved, tree = tree_positions(positions, num_spec[req_index], draft_index, shape)
        leaves = tree >= 0
        buffers.positions.np[:total] = moved  # a leaf's rope position (its slot stays)
        buffers.tree_prefix.np[:total] = tree
    block_ids = states.block_table[token_rows, positions // block_size]
    buffers.slot_mapping.np[:total] = block_ids * block_size + positions % block_size
    buffers.query_start_loc.np[0] = 0
    buffers.query_start_loc.np[1:num_reqs + 1] = cu_num
    seq_lens = computed + num_scheduled
    buffers.seq_lens.np[:num_reqs] = seq_lens
    buffers.block_table.np[:num_reqs] = states.block_table[rows]

    # A chunk samples when it reaches the last known token; it then reads logits at
    # the 1 + s rows from its last known token (s drafts to verify plus the bonus
    # position): its last rows, but for a tree's leaves after them.
    samples = seq_lens >= states.num_tokens[rows]
    num_logits_per_req = np.where(samples, 1 + chain, 0)
    cu_logits = np.cumsum(num_logits_per_req)
    num_logits = int(cu_logits[-1]) if num_reqs else 0
    # e.g. cu_num [2, 7, 10], logits per req [1, 0, 3] -> [1, 7, 8, 9]
    logit_req = np.repeat(np.arange(num_reqs), num_logits_per_req)
    logit_offsets = np.arange(num_logits) - np.repeat(cu_logits - num_logits_per_req,
                                                      num_logits_per_req)
    buffers.logits_indices.np[:num_logits] = (cu_num[logit_req] - 1 - num_spec[logit_req]
                                              + logit_offsets)
    num_leaf_logits = 0
    if leaves is not None:
        leaf_rows = np.flatnonzero(leaves & samples[req_index])
        num_leaf_logits = len(leaf_rows)
        buffers.logits_indices.np[num_logits:num_logits + num_leaf_logits] = leaf_rows
    return PreparedStep(
        req_ids=req_ids, rows=rows, num_scheduled=num_scheduled, num_tokens=total,
        samples=samples, num_spec=num_spec, num_logits=num_logits,
        max_query_len=int(num_scheduled.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        num_chain=chain, has_leaves=leaves is not None and bool(leaves.any()),
        num_leaf_logits=num_leaf_logits,
    )
