"""Each head method's serving passes, seen as the unrolled steps training runs.

Training runs one window of T positions through `steps` in turn; step j's row r sits
at position r and belongs to the drafting chain anchored at a = r - j, whose context
(step 0's keys up to a) the drafter's KV cache holds when serving, and whose later
rows are on the diagonal (step i's key at row r - (j - i)). Only the inputs of each
step and the row each loss reads differ by method, exactly as in the passes
spec_decode/methods/*.py lay out (each head method's `train_layout`, a `TrainLayout`):

  method      context row p        later steps (inputs)                      loss on
  eagle, mtp  hidden(p), tok p + 1 k - 1 x feedback: own output at p - 1,    every step
                                   tok p + 1
  parallel    hidden(p), tok p + 1 k - 1 x mask: mask_hidden, MASK_TOKEN_ID  every step
  dflash      hidden(p), tok p     bonus: mask_hidden, tok p; then k x mask  the k masks

A row whose label index is t predicts `labels[t]`, the target's greedy token after
position t (eagle, parallel: t = r + 1, the token two on from the row; dflash: t =
r - 1, the token at the row's own position). A step trains only where every earlier
draft of its chain equals the target's greedy token: serving never runs a later
draft past a rejected one, and mask rows, which never see the tokens in between, can
only be right about the greedy chain.
"""

from __future__ import annotations

import torch

from spec_decode.methods import TrainLayout, get_method
from training.options import trainable_methods

MASK_TOKEN_ID = 0  # the drafter's default `mask_token_id` (runner/drafter.py)


def train_layout(method: str) -> TrainLayout:
    """The layout `method`'s head trains in: its class's `train_layout`."""
    layout = get_method(method).train_layout
    if layout is None:
        raise ValueError(f"speculative method {method!r} has no head to train (no "
                         f"train_layout); choose one of {', '.join(trainable_methods())}")
    return layout


def greedy_run(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[N, T]: how many consecutive positions up to and including p had the target's
    greedy token next (tokens[p + 1] == labels[p]); 0 where that fails."""
    agree = torch.zeros_like(tokens, dtype=torch.bool)
    agree[:, :-1] = (tokens[:, 1:] == labels[:, :-1]) & (labels[:, :-1] >= 0)
    index = torch.arange(tokens.shape[1]).expand_as(tokens)
    last_miss = torch.cummax(torch.where(agree, -1, index), dim=1).values
    return index - last_miss


def step_targets(layout: TrainLayout, labels: torch.Tensor, run: torch.Tensor, rows: int,
                 step: int, ignore: int) -> torch.Tensor:
    """[N, rows] the label each row of `step` trains on, or `ignore`."""
    offset = layout.label_offset
    t = torch.arange(rows) + offset
    inside = (t >= 0) & (t < labels.shape[1])
    target = torch.where(inside, labels[:, t.clamp(0, labels.shape[1] - 1)], ignore)
    needed = step - layout.first_loss_step  # earlier drafts of the chain
    r = torch.arange(rows)
    valid = (r >= step)[None, :].expand_as(target)  # the chain's anchor r - step >= 0
    if needed > 0:
        prev = t - 1  # the chain's last drafted position is the one before the label's
        ok = run[:, prev.clamp(min=0)] >= needed
        valid = valid & ok & (prev >= 0)[None, :]
    return torch.where(valid & inside[None, :], target, ignore)


def live_rows(scored: list[torch.Tensor]) -> list[torch.Tensor]:
    """[N, rows] per step: the rows whose result a scored row reads, given each step's
    scored rows `scored[j]` (a row with a label there). Nothing reads a row of a chain
    none of whose later steps is scored (prompt text, padding past an answer's end):
    a later step's row reads only its own chain's earlier rows (the diagonal), and the
    context step's rows up to its anchor + 1. So those rows need no forward at all;
    the context step's rows run up to the last one a live chain or its own loss reads
    (its attention is causal, so the rows before it stay live)."""
    num, rows = scored[0].shape
    # chain[j][:, a]: whether step j of the chain anchored at a is scored.
    device = scored[0].device
    chain = [torch.zeros(num, rows, dtype=torch.bool, device=device) for _ in scored]
    for j, step in enumerate(scored):
        chain[j][:, :max(rows - j, 0)] = step[:, j:]  # none past the window's end
    needed = torch.zeros_like(chain[0])  # whether step j or a later one is scored
    later: list[torch.Tensor] = []  # steps 1.. of the live rows, built last step first
    for j in range(len(scored) - 1, 0, -1):
        needed = needed | chain[j]
        step = torch.zeros_like(needed)
        step[:, j:] = needed[:, :max(rows - j, 0)]
        later.insert(0, step)
    # Context row p is read by a live chain anchored at a >= p - 1 (the closure below
    # then keeps every row before it).
    wanted = scored[0].clone()
    wanted[:, 1:] |= needed[:, :-1]
    context = torch.flip(torch.cummax(torch.flip(wanted.int(), [1]), dim=1).values, [1]) > 0
    return [context, *later]
