"""Training an EAGLE-3 head with training-time test (TTT).

The head is unrolled `depth` times on its own hidden states, as it drafts when serving:
step 1 reads fc(target features) at position r and the token at r + 1; step j reads
step j - 1's output at r - 1. Each step's row at position r attends to step 1's keys
up to r - (j - 1) (the context the drafter's KV cache holds) and to the earlier
steps' keys on its own diagonal (the drafts written since), exactly the keys a
sequential drafting step sees. Labels are the target's own greedy tokens, over a
reduced draft vocabulary (the most frequent labels; `d2t` maps back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from runner.eagle3 import Eagle3Head
from runner.models.llama import apply_rope

IGNORE = -100


@dataclass(frozen=True)
class Batch:
    """Windows of one training batch: features, teacher-forced tokens, labels."""

    aux: torch.Tensor  # [N, T, 3H]
    tokens: torch.Tensor  # [N, T]
    labels: torch.Tensor  # [N, T] draft ids of the target's greedy tokens, or IGNORE


def draft_vocab(labels: torch.Tensor, vocab_size: int, size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent labels: (d2t offsets [size], t2d [vocab] draft id or -1).

    Draft ids follow ascending target ids, as published EAGLE-3 checkpoints store them.
    """
    counts = torch.bincount(labels.reshape(-1), minlength=vocab_size)
    top = torch.sort(torch.topk(counts, size).indices).values
    t2d = torch.full((vocab_size,), -1, dtype=torch.int64)
    t2d[top] = torch.arange(size)
    return top - torch.arange(size), t2d


def _step(head: Eagle3Head, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, prior: list[tuple[torch.Tensor, torch.Tensor]]
          ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One unrolled step over [N, T] rows; `prior` holds earlier steps' (K, V)."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    num, length, _ = hidden.shape
    x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), dim=-1)
    q = attn.q_proj(x).view(num, length, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(num, length, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(num, length, attn.num_kv_heads, attn.head_dim)
    q = apply_rope(q, cos[:, None, :], sin[:, None, :]).transpose(1, 2)  # [N, Hq, T, D]
    k = apply_rope(k, cos[:, None, :], sin[:, None, :]).transpose(1, 2)
    v = v.transpose(1, 2)
    group = attn.num_heads // attn.num_kv_heads
    keys = [(kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1))
            for kk, vv in [*prior, (k, v)]]
    j = len(keys)  # this step's number
    rows = torch.arange(length, device=x.device)
    # Step 1's keys: causal, up to r - (j - 1).
    k1, v1 = keys[0]
    scores = [q @ k1.transpose(-1, -2) * attn.scale]
    allowed = rows[None, :] <= rows[:, None] - (j - 1)
    scores[0] = scores[0].masked_fill(~allowed, float("-inf"))
    shifted_values = []
    for i in range(2, j + 1):  # step i's key at r - (j - i): its draft on this diagonal
        shift = j - i
        ki, vi = keys[i - 1]
        ks = F.pad(ki, (0, 0, shift, 0))[:, :, :length]
        vs = F.pad(vi, (0, 0, shift, 0))[:, :, :length]
        diag = (q * ks).sum(-1, keepdim=True) * attn.scale
        scores.append(diag.masked_fill((rows < shift)[None, None, :, None], float("-inf")))
        shifted_values.append(vs)
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = probs[..., :length] @ v1
    for n, vs in enumerate(shifted_values):
        out = out + probs[..., length + n:length + n + 1] * vs
    out = out.transpose(1, 2).reshape(num, length, -1)
    h = hidden + attn.o_proj(out)
    return h + layer.mlp(layer.post_attention_layernorm(h)), (k, v)


def hidden_device(head: Eagle3Head) -> torch.device:
    return head.fc.weight.device


def unrolled_loss(head: Eagle3Head, batch: Batch, depth: int, decay: float = 0.8
                  ) -> tuple[torch.Tensor, list[float]]:
    """Weighted cross-entropy over `depth` unrolled steps; top-1 accuracy per step."""
    aux, tokens, labels = batch.aux, batch.tokens, batch.labels
    length = tokens.shape[1] - 1  # rows r = 0 .. T - 2 read the token at r + 1
    dtype = head.fc.weight.dtype
    cos, sin = head.rope(torch.arange(length, device=hidden_device(head)), dtype)
    cos, sin = cos[:, 0], sin[:, 0]  # [T, D]
    embeds = head.embed(tokens[:, 1:]).to(dtype).detach()  # the target stays frozen
    target = labels[:, 1:]
    hidden = head.project(aux[:, :length])
    prior: list[tuple[torch.Tensor, torch.Tensor]] = []
    total, accs = torch.zeros((), device=hidden.device), []
    for j in range(depth):
        out, kv = _step(head, embeds, hidden, cos, sin, prior)
        prior.append(kv)
        logits = head.lm_head(head.norm(out)).float()
        # Step j + 1 predicts for row r the same label as step 1, from drafts since r - j.
        step_target = target.clone()
        step_target[:, :j] = IGNORE
        total = total + decay ** j * F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), step_target.reshape(-1), ignore_index=IGNORE)
        valid = step_target != IGNORE
        hits = (logits.argmax(-1) == step_target) & valid
        accs.append(float(hits.sum()) / max(1, int(valid.sum())))
        hidden = F.pad(out, (0, 0, 1, 0))[:, :length]  # row r reads step j's output at r - 1
    return total / sum(decay ** j for j in range(depth)), accs


def lr_at(update: int, total: int, peak: float, warmup: int = 20) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    if update < warmup:
        return peak * (update + 1) / warmup
    progress = (update - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; the same config and seed give the same head."""

    updates: int = 2000
    batch_size: int = 8
    lr: float = 1e-3
    depth: int = 3  # unrolled steps (training-time test)
    seed: int = 0
    checkpoint_every: int = 200


def select(data: Batch, index: torch.Tensor) -> Batch:
    return Batch(data.aux[index], data.tokens[index], data.labels[index])


@torch.no_grad()
def evaluate(head: Eagle3Head, data: Batch, depth: int, batch_size: int = 16
             ) -> tuple[float, list[float]]:
    """Mean loss and top-1 agreement per unrolled step, over every window."""
    losses, accs = [], []
    for start in range(0, len(data.tokens), batch_size):
        index = torch.arange(start, min(start + batch_size, len(data.tokens)))
        loss, acc = unrolled_loss(head, select(data, index), depth)
        losses.append(float(loss.detach()))
        accs.append(acc)
    return sum(losses) / len(losses), [sum(a[j] for a in accs) / len(accs)
                                       for j in range(depth)]


def train_head(head: Eagle3Head, data: Batch, config: TrainConfig,
               checkpoint: Path | None = None, progress: bool = True,
               stop_at: int | None = None) -> list[float]:
    """AdamW over shuffled windows; resumes from `checkpoint` when it exists and
    saves it every `checkpoint_every` updates. `stop_at` ends the run early at that
    update (a time-boxed session; the schedule still follows `config.updates`).
    Returns the loss of each update run."""
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    start = 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        start = state["update"]
    losses: list[float] = []
    num = len(data.tokens)
    bar = tqdm(range(start, min(config.updates, stop_at or config.updates)),
               desc="train-drafter", disable=not progress, initial=start, total=config.updates)
    for update in bar:
        # Each epoch's order comes from (seed, epoch) alone, so a resumed run sees the
        # same batches as an unbroken one.
        first = update * config.batch_size
        epoch = first // num
        order = torch.randperm(num, generator=torch.Generator().manual_seed(
            config.seed * 1_000_003 + epoch))
        index = order[torch.arange(first, first + config.batch_size) % num]
        for group in opt.param_groups:
            group["lr"] = lr_at(update, config.updates, config.lr)
        loss, accs = unrolled_loss(head, select(data, index), config.depth)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", acc1=f"{accs[0]:.2f}")
        if checkpoint is not None and (update + 1) % config.checkpoint_every == 0:
            _save(checkpoint, head, opt, update + 1)
    if checkpoint is not None and losses:  # where the run stopped, early or not
        _save(checkpoint, head, opt, start + len(losses))
    return losses


def _save(path: Path, head: Eagle3Head, opt: torch.optim.Optimizer, update: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "update": update}, tmp)
    tmp.replace(path)  # a crash mid-write never leaves a broken checkpoint
