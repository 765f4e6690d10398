"""Fill the step buffers from a SchedulerOutput with vectorised numpy (no per-token loops)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runner.buffers import StepBuffers
from runner.request_states import RequestStates


@dataclass
class PreparedStep:
    """What input preparation learned, in scheduled order (one entry per request)."""

    req_ids: list[str]
    rows: np.ndarray  # [num_reqs] state rows
    num_scheduled: np.ndarray  # [num_reqs]
    num_tokens: int  # total rows of the target pass
    samples: np.ndarray  # [num_reqs] bool: the chunk reaches a sampling position
    num_spec: np.ndarray  # [num_reqs] drafts verified
    num_logits: int  # rows of logits to compute (1 + s per sampling request)
    max_query_len: int
    max_seq_len: int


def write_spec_tokens(states: RequestStates, spec: dict[str, list[int]]) -> None:
    """Drafts to verify sit right after the known tokens, where the chunk reads them."""
    for req_id, drafts in spec.items():
        row = states.row_of[req_id]
        start = states.num_tokens[row]
        states.token_ids[row, start:start + len(drafts)] = drafts


def prepare_inputs(states: RequestStates, buffers: StepBuffers, req_ids: list[str],
                   num_scheduled: np.ndarray, num_spec: np.ndarray,
                   block_size: int) -> PreparedStep:
    """Positions, token ids, slots, query starts, sequence lengths and logits rows.

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
    positions = computed[req_index] + offsets
    token_rows = rows[req_index]

    buffers.positions.np[:total] = positions
    buffers.input_ids.np[:total] = states.token_ids[token_rows, positions]
    block_ids = states.block_table[token_rows, positions // block_size]
    buffers.slot_mapping.np[:total] = block_ids * block_size + positions % block_size
    buffers.query_start_loc.np[0] = 0
    buffers.query_start_loc.np[1:num_reqs + 1] = cu_num
    seq_lens = computed + num_scheduled
    buffers.seq_lens.np[:num_reqs] = seq_lens
    buffers.block_table.np[:num_reqs] = states.block_table[rows]

    # A chunk samples when it reaches the last known token; it then reads logits at
    # its last 1 + s rows (s drafts to verify plus the bonus position).
    samples = seq_lens >= states.num_tokens[rows]
    num_logits_per_req = np.where(samples, 1 + num_spec, 0)
    cu_logits = np.cumsum(num_logits_per_req)
    num_logits = int(cu_logits[-1]) if num_reqs else 0
    # e.g. cu_num [2, 7, 10], logits per req [1, 0, 3] -> [1, 7, 8, 9]
    logit_req = np.repeat(np.arange(num_reqs), num_logits_per_req)
    logit_offsets = np.arange(num_logits) - np.repeat(cu_logits - num_logits_per_req,
                                                      num_logits_per_req)
    buffers.logits_indices.np[:num_logits] = (cu_num[logit_req] - num_logits_per_req[logit_req]
                                              + logit_offsets)
    return PreparedStep(
        req_ids=req_ids, rows=rows, num_scheduled=num_scheduled, num_tokens=total,
        samples=samples, num_spec=num_spec, num_logits=num_logits,
        max_query_len=int(num_scheduled.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
    )
