"""Training an EAGLE-3 head with training-time test (TTT).

The head is unrolled as it drafts when serving, one step per draft of a chain, in the
serving layout of its method (training/layouts.py: eagle feeds its own output back,
parallel and dflash feed mask rows). Each step's row at position r attends to the
context step's keys up to its chain's anchor and to the earlier steps' keys on its
own diagonal (the rows written since), exactly the keys that row sees when serving.
Labels are the target's own greedy tokens, over a reduced draft vocabulary (the most
frequent labels; `d2t` maps back).
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from runner.eagle3 import Eagle3Head, Eagle3Layer
from runner.models.llama import LlamaDecoderLayer, LlamaForCausalLM, apply_rope
from spec_decode.methods import TrainLayout
from training.layouts import MASK_TOKEN_ID, live_rows, step_targets, train_layout
from training.vocab_loss import head_cross_entropy, matmul_dtype

logger = logging.getLogger("specbudget.training")
IGNORE = -100  # no label: padding, prompt text, a row outside its chain
MISSING = -1  # the target's token lies outside the draft vocabulary: no loss, a miss
EAGLE = train_layout("eagle")


@dataclass(frozen=True)
class Batch:
    """Windows of one training batch: features, teacher-forced tokens, labels."""

    aux: torch.Tensor  # [N, T, 3H]
    tokens: torch.Tensor  # [N, T]
    labels: torch.Tensor  # [N, T] draft ids of the target's greedy tokens, MISSING or IGNORE
    chain: torch.Tensor  # [N, T] layouts.greedy_run of the tokens and target-id labels
    # Soft targets: the target's final normed hidden state [N, T, H] at each position,
    # and its LM head's rows for the draft vocabulary [draft vocab, H] (frozen): the
    # target's distribution over the draft vocabulary is their product's softmax.
    final: torch.Tensor | None = None
    teacher: torch.Tensor | None = None


def draft_vocab(labels: torch.Tensor, vocab_size: int, size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent labels: (d2t offsets [size], t2d [vocab] draft id or -1).

    Past the distinct labels (11,009 in the default data), the lowest target ids that
    no label names: byte-level BPE numbers its merges in the order it learnt them, most
    frequent first, where topk's order among equal (zero) counts is arbitrary. Draft
    ids follow ascending target ids, as published EAGLE-3 checkpoints store them.
    """
    counts = torch.bincount(labels.reshape(-1), minlength=vocab_size)
    labelled = min(size, int((counts > 0).sum()))
    top = torch.topk(counts, labelled).indices
    if size > labelled:
        unlabelled = torch.nonzero(counts == 0).squeeze(1)  # ascending ids
        top = torch.cat([top, unlabelled[:size - labelled]])
    top = torch.sort(top).values
    t2d = torch.full((vocab_size,), MISSING, dtype=torch.int64)
    t2d[top] = torch.arange(size)
    return top - torch.arange(size), t2d


def init_from_target(head: Eagle3Head, target: LlamaForCausalLM, d2t: torch.Tensor,
                     layer: bool = True) -> None:
    """Set the draft vocabulary, and start the LM head and final norm as the target's
    own (its LM head's rows for the draft vocabulary): the head's output then starts
    in the space the target's last hidden state lives in, which little data can reach.
    With `layer`, its decoder layer too (`init_layer_from_target`)."""
    with torch.no_grad():
        head.d2t.copy_(d2t)
        ids = torch.arange(len(d2t), device=d2t.device) + d2t
        head.lm_head.weight.copy_(target.lm_head.weight[ids.to(target.lm_head.weight.device)])
        head.norm.weight.copy_(target.model.norm.weight)
    if layer:
        init_layer_from_target(head, target)


def init_layer_from_target(head: Eagle3Head, target: LlamaForCausalLM) -> None:
    """Start the head as the target's layer L, L the highest layer whose input it reads:
    `fc` passes that input through, and the decoder layer's projections, norms and MLP
    are layer L's (its attention reads the hidden half of [embedding; hidden] as layer
    L reads its input; the embedding half keeps a tenth of its random start, to be
    learnt). The head then starts as the target does from layer L on, two layers
    short, where from a random start its one layer learnt that path from the data
    alone. Measured (`specbudget train-drafter --method eagle` on the cached data,
    README): held-out agreement 36.5 / 32.2 / 29.7 / 26.4 % against 33.7 / 28.7 / 27.7
    / 25.8, served mean acceptance length 1.87 against 1.79, at the same cost."""
    aux = list(head.aux_layer_ids)
    top = max(aux)
    source = target.model.layers[top]
    assert isinstance(source, LlamaDecoderLayer)
    width = head.config.hidden_size
    mid = head.midlayer
    with torch.no_grad():
        block = aux.index(top)
        head.fc.weight.zero_()
        head.fc.weight[:, block * width:(block + 1) * width].copy_(
            torch.eye(width, dtype=head.fc.weight.dtype))
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = getattr(mid.self_attn, name).weight
            weight[:, :width].mul_(0.1)
            weight[:, width:].copy_(getattr(source.self_attn, name).weight)
        mid.self_attn.o_proj.weight.copy_(source.self_attn.o_proj.weight)
        mid.hidden_norm.weight.copy_(source.input_layernorm.weight)
        mid.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mid.mlp, name).weight.copy_(getattr(source.mlp, name).weight)
        # A deeper head's later layers go on as the target's: L + 1, L + 2, ...
        for i, extra in enumerate(head.extra_layers, start=1):
            extra.load_state_dict(target.model.layers[top + i].state_dict())


def expected_length(agreement: list[float]) -> float:
    """Tokens per verification step implied by conditional per-draft agreement:
    1 (the bonus) + sum over j of the chance drafts 1..j all pass."""
    total, chance = 1.0, 1.0
    for a in agreement:
        chance *= a
        total += chance
    return total


def _rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """[N, T, D] -> [M, D]: the rows `index` names (flat over N * T), or all of them."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if index is None else flat.index_select(0, index)


def _placed(flat: torch.Tensor, index: torch.Tensor | None, num: int, length: int
            ) -> torch.Tensor:
    """[M, D] -> [N, T, D]: `_rows` undone, zeros in the rows it left out."""
    if index is not None:
        flat = flat.new_zeros(num * length, flat.shape[-1]).index_copy(0, index, flat)
    return flat.view(num, length, -1)


KV = tuple[torch.Tensor, torch.Tensor]


def _step(head: Eagle3Head, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, prior: list[tuple[KV, ...]], live: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, tuple[KV, ...]]:
    """One unrolled step over [N, T] rows through each of the head's layers; `prior`
    holds earlier steps' (K, V) per layer. The row-wise work (norms, projections, the
    MLP: nearly all of a step's time) runs on the `live` rows only (flat indices, None
    for all; `layouts.live_rows`): the others come out as zeros, which nothing scored
    reads."""
    layer, num = head.midlayer, hidden.shape[0]
    own = _rows(hidden, live)
    x = torch.cat((layer.input_layernorm(_rows(embeds, live)), layer.hidden_norm(own)), dim=-1)
    out, kv = _block(layer, x, own, cos, sin, [p[0] for p in prior], live, num)
    kvs = [kv]
    for i, extra in enumerate(head.extra_layers, start=1):
        assert isinstance(extra, LlamaDecoderLayer)
        own = _rows(out, live)
        out, kv = _block(extra, extra.input_layernorm(own), own, cos, sin,
                         [p[i] for p in prior], live, num)
        kvs.append(kv)
    return out, tuple(kvs)


def _block(layer: Eagle3Layer | LlamaDecoderLayer, x: torch.Tensor, own: torch.Tensor,
           cos: torch.Tensor, sin: torch.Tensor, prior: list[KV], live: torch.Tensor | None,
           num: int) -> tuple[torch.Tensor, KV]:
    """One decoder layer's attention (in the layout's pattern: `prior` holds this
    layer's K/V of earlier steps) and MLP over the live rows: `x` its normed input,
    `own` the residual, both [live rows, *]; [N, T, H] out (N = `num`)."""
    attn, length = layer.self_attn, cos.shape[0]
    q = _placed(attn.q_proj(x), live, num, length).view(num, length, attn.num_heads,
                                                         attn.head_dim)
    k = _placed(attn.k_proj(x), live, num, length).view(num, length, attn.num_kv_heads,
                                                         attn.head_dim)
    v = _placed(attn.v_proj(x), live, num, length).view(num, length, attn.num_kv_heads,
                                                         attn.head_dim)
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
    h = own + attn.o_proj(_rows(out, live))
    return _placed(h + layer.mlp(layer.post_attention_layernorm(h)), live, num, length), (k, v)


def hidden_device(head: Eagle3Head) -> torch.device:
    return head.fc.weight.device


def with_noise(aux: torch.Tensor, scale: float,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The features with Gaussian noise of `scale` times each row's RMS (a target
    layer's inputs grow with depth, so one absolute scale would drown the first and
    not touch the last): the head learns not to lean on any one feature's exact value,
    as its own fed-back outputs never match the target's exactly."""
    if scale <= 0.0:
        return aux
    x = aux.float()
    rms = x.pow(2).mean(dim=-1, keepdim=True).sqrt()
    noise = torch.randn(x.shape, generator=generator).to(x.device)
    return (x + scale * rms * noise).to(aux.dtype)


def unroll(head: Eagle3Head, aux: torch.Tensor, tokens: torch.Tensor, depth: int,
           layout: TrainLayout, live: list[torch.Tensor] | None = None
           ) -> list[torch.Tensor]:
    """Every step's output hidden states [N, rows, H], in the method's serving layout
    (training/layouts.py); rows = T - the layout's token shift. `live`: per step, the
    [N, rows] rows to run (`layouts.live_rows`; the others come out as zeros), or all."""
    shift = layout.token_shift
    rows = tokens.shape[1] - shift  # a context row at r reads the token at r + shift
    dtype = head.fc.weight.dtype
    cos, sin = head.rope(torch.arange(rows, device=hidden_device(head)), dtype)
    cos, sin = cos[:, 0], sin[:, 0]  # [T, D]
    embeds = head.embed(tokens[:, shift:]).to(dtype).detach()  # the target stays frozen
    mask_embeds = head.embed(torch.tensor([MASK_TOKEN_ID], device=tokens.device)
                             ).to(dtype).detach().expand_as(embeds)
    mask_hidden = head.mask_hidden.to(dtype).expand(*embeds.shape)
    kinds = layout.steps(depth)
    index: list[torch.Tensor | None] = (
        [None] * len(kinds) if live is None
        else [step.reshape(-1).nonzero().squeeze(1).to(embeds.device) for step in live])
    context = _placed(head.project(_rows(aux[:, :rows], index[0])), index[0], *embeds.shape[:2])
    prior: list[tuple[KV, ...]] = []
    outs: list[torch.Tensor] = []
    for kind, rows_now in zip(kinds, index, strict=True):
        inputs = {"context": (embeds, context), "bonus": (embeds, mask_hidden),
                  "mask": (mask_embeds, mask_hidden),
                  # row r reads the previous step's output at r - 1
                  "feedback": (embeds, F.pad(outs[-1], (0, 0, 1, 0))[:, :rows]
                               if outs else context)}[kind]
        out, kv = _step(head, *inputs, cos, sin, prior, rows_now)
        prior.append(kv)
        outs.append(out)
    return outs


def soft_loss(logits: torch.Tensor, final: torch.Tensor, teacher: torch.Tensor
              ) -> torch.Tensor:
    """Forward KL from the target's distribution over the draft vocabulary (its LM
    head's draft rows applied to its final hidden state, renormalised) to the head's:
    every token the target finds likely teaches, not only its argmax, and a position
    whose greedy token lies outside the draft vocabulary still teaches the rest."""
    want = torch.log_softmax(final.to(teacher.dtype) @ teacher.T, dim=-1)
    got = torch.log_softmax(logits.float(), dim=-1)
    return F.kl_div(got, want.float(), log_target=True, reduction="batchmean")


def unrolled_loss(head: Eagle3Head, batch: Batch, depth: int, layout: TrainLayout = EAGLE,
                  decay: float = 0.8, noise: float = 0.0,
                  generator: torch.Generator | None = None, live_only: bool = True
                  ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Weighted loss over the method's unrolled steps (soft targets where the batch
    has them, else cross-entropy on the greedy token); (top-1 hits, rows) of each step
    that drafts, over the rows where it trains. A MISSING label counts as a miss, as
    serving can never draft that token. `noise`: see `with_noise` (training only).
    `live_only`: run only the rows a scored row reads (`layouts.live_rows`; False runs
    every row, the same loss at more cost: benchmarks/update_rate.py)."""
    rows = batch.tokens.shape[1] - layout.token_shift
    num_steps = len(layout.steps(depth))
    targets = [step_targets(layout, batch.labels, batch.chain, rows, j, IGNORE)
               if j >= layout.first_loss_step else None for j in range(num_steps)]
    live = live_rows([torch.zeros(batch.labels.shape[0], rows, dtype=torch.bool,
                                  device=batch.labels.device)
                      if t is None else t != IGNORE for t in targets]) if live_only else None
    outs = unroll(head, with_noise(batch.aux, noise, generator), batch.tokens, depth, layout,
                  live)
    # Row r of every step predicts the label at r + label_offset (training/layouts.py).
    at = (torch.arange(rows) + layout.label_offset).clamp(0, batch.tokens.shape[1] - 1)
    losses, weights, accs = [], [], []
    lm_head = head.lm_head.weight
    if batch.final is None or batch.teacher is None:  # the fused loss runs: cast it once
        lm_head = lm_head.to(matmul_dtype(lm_head))  # for every step (vocab_loss.py)
    for j, out in enumerate(outs[layout.first_loss_step:], start=layout.first_loss_step):
        target = targets[j]
        assert target is not None
        scored = target != IGNORE
        if not bool(scored.any()):
            accs.append((0, 0))
            continue
        wanted = target[scored]
        weight = decay ** (j - layout.first_loss_step)
        if batch.final is not None and batch.teacher is not None:
            logits = head.compute_logits(out[scored])
            final = batch.final[:, at][scored]
            losses.append(weight * soft_loss(logits, final, batch.teacher))
            weights.append(weight)
            drafted = logits.detach().argmax(dim=-1)
        else:
            # The LM head fused with the loss (training/vocab_loss.py): a MISSING
            # label adds no loss and counts as a miss.
            loss, drafted = head_cross_entropy(head.norm(out[scored]), lm_head, wanted)
            if bool((wanted >= 0).any()):
                losses.append(weight * loss)
                weights.append(weight)
        accs.append((int((drafted == wanted).sum()), int(scored.sum())))
    total = torch.stack(losses).sum() if losses else outs[0].sum() * 0
    return total / max(sum(weights), 1e-9), accs


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
    depth: int = 4  # drafts per chain (K): the unrolled steps of training-time test
    method: str = "eagle"  # the serving layout trained for (training/layouts.py)
    seed: int = 0
    checkpoint_every: int = 200
    noise: float = 0.05  # on the fed features, times each row's RMS (`with_noise`)
    # AdamW's decoupled weight decay, against the head memorising its windows (several
    # epochs of them) far faster than its held-out agreement rises. 0.1 served the
    # same as none (eagle, measured: README), so none by default.
    weight_decay: float = 0.0
    # The head's matmuls under bfloat16 autocast (weights, optimiser state and the
    # loss stay float32): on a CPU with native bfloat16 an update costs half as much,
    # measured, so the same minutes buy twice the updates.
    autocast_bf16: bool = False


def select(data: Batch, index: torch.Tensor) -> Batch:
    final = data.final[index] if data.final is not None else None
    return Batch(data.aux[index], data.tokens[index], data.labels[index], data.chain[index],
                 final, data.teacher)


@torch.no_grad()
def evaluate(head: Eagle3Head, data: Batch, depth: int, method: str = "eagle",
             batch_size: int = 16) -> tuple[float, list[float]]:
    """Mean loss, and top-1 agreement of each draft with the target's greedy token
    where every earlier draft of its chain agreed (so the conditional acceptance)."""
    losses, hits, rows = [], [0] * depth, [0] * depth
    for start in range(0, len(data.tokens), batch_size):
        index = torch.arange(start, min(start + batch_size, len(data.tokens)))
        loss, accs = unrolled_loss(head, select(data, index), depth, train_layout(method))
        losses.append(float(loss.detach()))
        for j, (hit, num) in enumerate(accs):
            hits[j] += hit
            rows[j] += num
    return sum(losses) / len(losses), [h / max(1, n) for h, n in zip(hits, rows, strict=True)]


def adamw(params: list[torch.nn.Parameter], config: TrainConfig, fused: bool = True
          ) -> torch.optim.AdamW:
    """The optimiser `train_head` runs. Fused (one kernel over every tensor, the same
    update): unfused, its per-tensor divides and square roots took ~55 ms of a ~0.68 s
    update on this CPU (benchmarks/update_rate.py measures both)."""
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay,
                             fused=fused)


def train_head(head: Eagle3Head, data: Batch, config: TrainConfig,
               checkpoint: Path | None = None, progress: bool = True,
               stop_at: int | None = None, run_key: str = "") -> list[float]:
    """AdamW over shuffled windows; resumes from `checkpoint` when it exists and was
    written under the same `run_key` (what the run's data and settings hash to; a
    checkpoint of another run is ignored, with a warning), and saves it every
    `checkpoint_every` updates. `stop_at` ends the run early at that update (a
    time-boxed session; the schedule still follows `config.updates`). Returns the
    loss of each update run."""
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = adamw(params, config)
    start = 0
    state = _resumable(checkpoint, run_key)
    if state is not None:
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
        # The noise too comes from (seed, update) alone: a resumed run draws the same.
        noise_rng = torch.Generator().manual_seed(config.seed * 1_000_003 + update + 1)
        with torch.autocast(hidden_device(head).type, dtype=torch.bfloat16,
                            enabled=config.autocast_bf16), warnings.catch_warnings():
            # Autocast hands the head's RMSNorm bf16 input beside its float32 weight;
            # torch then normalises unfused (in float32, correct) and says so.
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            loss, accs = unrolled_loss(head, select(data, index), config.depth,
                                       train_layout(config.method), noise=config.noise,
                                       generator=noise_rng)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", acc1=f"{accs[0][0] / max(1, accs[0][1]):.2f}")
        if checkpoint is not None and (update + 1) % config.checkpoint_every == 0:
            _save(checkpoint, head, opt, update + 1, run_key)
    if checkpoint is not None and losses:  # where the run stopped, early or not
        _save(checkpoint, head, opt, start + len(losses), run_key)
    return losses


def _resumable(path: Path | None, run_key: str) -> dict | None:
    """The checkpoint at `path` if this run wrote it, else None."""
    if path is None or not path.exists():
        return None
    state: dict = torch.load(path, weights_only=False)
    if state.get("run_key", "") != run_key:
        logger.warning("%s was written by another run (other data or settings): "
                       "training from the start", path)
        return None
    return state


def _save(path: Path, head: Eagle3Head, opt: torch.optim.Optimizer, update: int,
          run_key: str) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "update": update,
                "run_key": run_key}, tmp)
    tmp.replace(path)  # a crash mid-write never leaves a broken checkpoint
