"""The runner's persistent per-request state: one row per running request.

Rows are reused as requests come and go; arrays are allocated once, sized by
max_num_seqs (and max_model_len for token ids and block tables).
"""

from __future__ import annotations

import numpy as np
import torch

from scheduler.outputs import NewRequestData


class RequestStates:
    """Token ids, counters, block tables and sampling settings, indexed by row."""

    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_req: int,
                 device: torch.device) -> None:
        self.device = device
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)  # known: prompt + output
        self.num_prompt = np.zeros(max_num_seqs, dtype=np.int64)
        self.max_tokens = np.zeros(max_num_seqs, dtype=np.int64)  # the runner's own copy
        self.num_computed = np.zeros(max_num_seqs, dtype=np.int64)
        # Positions the drafter's own KV holds: c, or less while the request is parked
        # (the runner's own count, against which it builds the catch-up rows).
        self.num_drafter_computed = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_seqs, dtype=np.float32)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_seqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_seqs, -1, dtype=np.int64)  # -1: none asked
        self.seeds: dict[int, int] = {}  # row -> seed, for seeded random requests
        # row -> (min_tokens, the token ids it keeps from being sampled until then), for
        # requests with min_tokens > 0 and something to suppress.
        self.min_tokens: dict[int, tuple[int, list[int]]] = {}
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.seeds.pop(row, None)
            self.min_tokens.pop(row, None)
            self._free_rows.append(row)

    def add(self, new: NewRequestData) -> None:
        self.remove(new.req_id)  # a preempted request comes back as new
        row = self._free_rows.pop()
        self.row_of[new.req_id] = row
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, :len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt[row] = len(new.prompt_token_ids)
        self.max_tokens[row] = new.sampling_params.max_tokens
        self.num_computed[row] = new.num_computed_tokens
        self.num_drafter_computed[row] = new.num_drafter_computed_tokens
        self.num_blocks[row] = 0
        self._append_blocks(row, new.block_ids)
        params = new.sampling_params
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.min_p[row] = params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        if params.seed is not None and params.temperature > 0:
            # Its draws are keyed by (seed, position): never by the batch or the drafts.
            self.seeds[row] = params.seed
        stops = list(params.stop_token_ids)
        if new.eos_token_id is not None and not params.ignore_eos:
            stops.append(new.eos_token_id)
        if params.min_tokens > 0 and stops:
            self.min_tokens[row] = (params.min_tokens, stops)

    def update(self, req_id: str, new_block_ids: list[int], num_computed_tokens: int) -> None:
        """A running request's step (`CachedRequestData` entry)."""
        row = self.row_of[req_id]
        self.num_computed[row] = num_computed_tokens
        self._append_blocks(row, new_block_ids)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)
