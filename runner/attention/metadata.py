"""Per-step attention metadata: an explicit object passed to forward, never a global."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where each request's queries sit in the flat batch and where its KV lives.

    Worked example: three requests scheduled with [2, 5, 3] tokens, already holding
    [10, 0, 7] computed tokens, block_size 4:
      query_start_loc = [0, 2, 7, 10]     # request i's queries: [qsl[i], qsl[i+1])
      seq_lens        = [12, 5, 10]       # computed + scheduled: keys each one sees
      slot_mapping[t] = block_table[req(t), pos(t) // 4] * 4 + pos(t) % 4
    Query j of request i sits at position seq_lens[i] - num_query_i + j and attends
    causally to every key at or before that position.

    Tree rows (a drafted token tree's leaves, verified in the same pass as its chain):
    `tree_prefix[t] = v >= 1` makes row t see only the keys before position v and its
    own key, as if it sat at position v (its rope position is v, set by the caller);
    -1 is a plain causal row. A tree row's result is bitwise the one it would have at
    position v of a sequence without the keys it skips (runner/attention backends).
    """

    num_actual_tokens: int
    num_reqs: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    max_query_len: int
    max_seq_len: int
    # Host copies for the torch path's per-request loop (no device syncs there).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # [num_actual_tokens] int32 on the device and its host copy, or None: no tree rows.
    tree_prefix: torch.Tensor | None = None
    tree_prefix_cpu: np.ndarray | None = None
