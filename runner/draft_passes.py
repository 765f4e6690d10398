"""Build each drafter forward pass as explicit rows, the same way for every method.

Every request's rows in a pass are contiguous positions [start, start + rows): first
the rows with real tokens (`valid`), then mask rows, then padding that only fills
positions the drafter will overwrite before it reads them (they sit at or past the
first position the next step recomputes). The runner counts these rows; it never asks
spec_decode's layout what they should be.

Per request after verification: c = computed before the step, n = scheduled, s =
drafts verified, a = accepted, L = n - s + a valid positions (n when it did not
sample), b = the bonus / recovered token at position c + L, k = drafts to propose.

  method       pass      start   rows (k>0 / k=0)   valid        masks  drafts read at
  eagle, mtp   draft     c       n / n              L (shifted)  0      L-1, then k-1 steps
  draft_model  draft     c       n+1 / n            L+1          0      L, then k-1 steps
  parallel     draft     c       n+k-1 / n          L (shifted)  k-1    L-1 .. L+k-2
  pard         draft     c       n+k / n            L+1          k-1    L .. L+k-1
  dflash       context   c       n / n              L            0      -
  dflash       query     c+L     k+1 / 0            1 (b)        k      1 .. k
"Shifted" rows pair position p's target hidden state with the token at p + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MASK_ROW = -1  # hidden_src of a row with no target hidden state (mask / query rows)


@dataclass
class StepResult:
    """Per scheduled request (scheduled order), what verification left behind."""

    rows: np.ndarray  # [R] state rows
    computed: np.ndarray  # [R] c
    num_scheduled: np.ndarray  # [R] n
    q_start: np.ndarray  # [R] first target-pass row of each request
    valid: np.ndarray  # [R] L
    samples: np.ndarray  # [R] bool
    num_drafts: np.ndarray  # [R] k (0 when not sampling)


@dataclass
class DraftPass:
    """One pass's rows; `readout` lists the rows whose outputs become drafts."""

    name: str
    req_index: np.ndarray  # [rows] scheduled-request index of each row
    positions: np.ndarray  # [rows]
    token_ids: np.ndarray  # [rows]
    hidden_src: np.ndarray  # [rows] target-pass row to read, or MASK_ROW
    rows_per_req: np.ndarray  # [R]
    starts: np.ndarray  # [R] first position of each request's rows
    readout: np.ndarray  # [sum drafts read here] pass-row indices, request-major

    @property
    def num_rows(self) -> int:
        return len(self.positions)


def _pass(name: str, res: StepResult, token_ids: np.ndarray, starts: np.ndarray,
          rows: np.ndarray, valid: np.ndarray, masks: np.ndarray, shift: int,
          read_from: np.ndarray, num_read: np.ndarray, mask_id: int,
          conditioned: bool) -> DraftPass:
    """Rows for every request: `valid` real tokens, `masks` mask rows, then padding.

    Worked example, rows [3, 2], valid [2, 2], masks [1, 0], starts [5, 0]:
      req_index = [0, 0, 0, 1, 1]; j = [0, 1, 2, 0, 1]; positions = [5, 6, 7, 0, 1]
      kinds     = [tok, tok, mask, tok, tok]
    """
    num = len(rows)
    cu = np.cumsum(rows)
    total = int(cu[-1]) if num else 0
    req_index = np.repeat(np.arange(num), rows)
    j = np.arange(total) - np.repeat(cu - rows, rows)
    positions = starts[req_index] + j
    is_tok = j < valid[req_index]
    is_mask = ~is_tok & (j < (valid + masks)[req_index])
    tok_pos = np.minimum(positions + shift, token_ids.shape[1] - 1)
    tokens = np.where(is_tok, token_ids[res.rows[req_index], tok_pos],
                      np.where(is_mask, mask_id, 0))
    # Context rows read the target's hidden state at the same position.
    target_row = res.q_start[req_index] + (positions - res.computed[req_index])
    hidden_src = np.where(is_tok & conditioned, target_row, MASK_ROW)
    read_req = np.repeat(np.arange(num), num_read)
    read_j = np.arange(int(num_read.sum())) - np.repeat(np.cumsum(num_read) - num_read,
                                                         num_read)
    readout = (cu - rows)[read_req] + read_from[read_req] + read_j
    return DraftPass(name, req_index, positions, tokens.astype(np.int64), hidden_src,
                     rows, starts, readout)


def pass_rows(method: str, n: np.ndarray, k: np.ndarray) -> dict[str, np.ndarray]:
    """Rows per request of each wide pass, from n and k alone: known before the step
    runs, so the runner can assert the budget before writing any buffer."""
    drafting = (k > 0).astype(np.int64)
    if method in ("eagle", "mtp"):
        return {"draft": n}
    if method == "parallel":
        return {"draft": np.where(drafting, n + k - 1, n)}
    if method == "draft_model":
        return {"draft": n + drafting}
    if method == "pard":
        return {"draft": n + k}
    if method == "dflash":
        return {"context": n, "query": np.where(drafting, k + 1, 0)}
    return {}


def build_passes(method: str, res: StepResult, token_ids: np.ndarray,
                 mask_id: int) -> list[DraftPass]:
    """The method's wide passes (sequential one-row steps are built by the drafter)."""
    c, n, L, k = res.computed, res.num_scheduled, res.valid, res.num_drafts
    rows = pass_rows(method, n, k)
    drafting = (k > 0).astype(np.int64)
    zero = np.zeros_like(n)
    masks = np.maximum(k - 1, 0)
    # Unshifted: the bonus token at c + L is a real token of the pass when sampling.
    with_bonus = np.where(res.samples, np.minimum(L + 1, rows.get("draft", n)), L)
    if method in ("eagle", "mtp"):
        return [_pass("draft", res, token_ids, c, rows["draft"], L, zero, 1, L - 1, drafting,
                      mask_id, True)]
    if method == "parallel":
        return [_pass("draft", res, token_ids, c, rows["draft"], L, masks, 1, L - 1, k,
                      mask_id, True)]
    if method == "draft_model":
        return [_pass("draft", res, token_ids, c, rows["draft"], with_bonus, zero, 0, L,
                      drafting, mask_id, False)]
    if method == "pard":
        return [_pass("draft", res, token_ids, c, rows["draft"], with_bonus, masks, 0, L, k,
                      mask_id, False)]
    if method == "dflash":
        context = _pass("context", res, token_ids, c, n, L, zero, 0, zero, zero, mask_id, True)
        query = _pass("query", res, token_ids, c + L, rows["query"], drafting, k, 0,
                      np.ones_like(n), k, mask_id, False)
        return [context, query]
    raise ValueError(f"no drafter passes for method {method!r}")


def sequential_rows(method: str, k: np.ndarray) -> list[int]:
    """Rows of the one-row-per-request steps after the first pass (eagle/mtp/draft_model)."""
    if method not in ("eagle", "mtp", "draft_model"):
        return []
    return [int((k > j).sum()) for j in range(1, int(k.max(initial=0)))]
