"""min_tokens: EOS and a request's stop token ids held back until it has min_tokens
output tokens, on every logits row that would produce one of those tokens."""

from __future__ import annotations

import numpy as np
import torch

from runner.request_states import RequestStates


def before_min_tokens(states: RequestStates, logits: torch.Tensor, rows: np.ndarray,
                      counts: np.ndarray, ahead: np.ndarray | None = None) -> torch.Tensor:
    """The logits with EOS and the stop token ids at -inf in every row that would
    produce an output token before the request's min_tokens: a verification row is
    masked exactly as the decode row at that position would be, so drafts of those
    tokens are rejected as the target would reject them. Request i (state row
    `rows[i]`) owns the next `counts[i]` logits rows, in order, the first producing its
    output token `produced + ahead[i]` (a tree leaf's bonus row comes after the tokens
    verified before it). Logprobs stay the raw logits'. `logits` itself when no row
    needs it (a copy otherwise)."""
    if not states.min_tokens:  # the common step: nothing to look up
        return logits
    pending = [(i, row) for i, row in enumerate(rows.tolist()) if row in states.min_tokens]
    if not pending:
        return logits
    masked = logits.clone()
    starts = np.cumsum(counts) - counts
    for i, row in pending:
        min_tokens, stops = states.min_tokens[row]
        stops = [t for t in stops if t < masked.shape[1]]  # offline ids are unchecked
        produced = int(states.num_tokens[row] - states.num_prompt[row])
        produced += 0 if ahead is None else int(ahead[i])
        masked_rows = min(max(min_tokens - produced, 0), int(counts[i]))
        if masked_rows:
            start = int(starts[i])
            masked[start:start + masked_rows, stops] = float("-inf")
    return masked
