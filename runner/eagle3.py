"""EAGLE-3 draft head, in the layout published EAGLE-3 checkpoints use.

The head reads three of the target's hidden states per position (the inputs of a low,
a middle and a high layer, `aux_layer_ids`), concatenated and projected by `fc` to
one hidden state, and the embedding of the next token. Its first decoder layer
(`midlayer`) normalises each half on its own (`input_layernorm` for the embedding,
`hidden_norm` for the hidden state), attends over their concatenation (q/k/v take
2·hidden inputs), keeps the hidden state as the residual; a head of more than one
layer (`num_hidden_layers`, 1 in published EAGLE-3 heads) runs plain Llama decoder
layers after it (`extra_layers`), each with its own K/V. An LM head over a reduced
draft vocabulary gives draft ids, mapped to target ids by `d2t` (target id = draft id
+ d2t[draft id]). Later drafting steps feed the head's own output hidden state back
instead of fc(target features), as EAGLE-3 does.

Files: `config.json` (HF Llama fields plus `draft_vocab_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`) and `model.safetensors` with
`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t` (and optionally
`t2d`, `embed_tokens.weight`). Heads for methods with mask rows (parallel, dflash)
also carry `mask_hidden`, the hidden state a mask row starts from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from runner.attention import AttentionBackend, AttentionMetadata
from runner.models.linear import LinearKernel, PackedLinear
from runner.models.llama import (
    LlamaAttention,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    RMSNorm,
    Rotary,
    rope_inv_freq,
    vocab_projection,
)
from runner.models.top_confidence import top_confidence
from spec_decode.measured import MeasuredAcceptance
from spec_decode.passes import MASK_ROW
from spec_decode.sampling import greedy_ids

KVCache = tuple[torch.Tensor, torch.Tensor]
ARCHITECTURE = "LlamaForCausalLMEagle3"
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "d2t")
OPTIONAL = ("t2d", "embed_tokens.weight", "mask_hidden")


def trained_head_dir(target_path: Path, method: str) -> Path:
    """Where `specbudget train-drafter` puts the head for this target and method."""
    from runner.model_prep import default_cache_dir

    return default_cache_dir() / "heads" / target_path.name / method


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high: the inputs of layers 2, L/2 and L - 3 (EAGLE-3's choice)."""
    return (2, num_layers // 2, num_layers - 3)


# Positions a packed head's table of rotations holds (2 MB at 8,192 and head size 64
# in bfloat16); a later position's rotation is computed as `rope` computes it.
ROTARY_TABLE_MAX = 32768


@dataclass(frozen=True)
class Eagle3Config:
    """A head's architecture: the target's Llama fields, its draft vocabulary and the
    target layers it reads."""

    llama: LlamaConfig  # hidden size, heads, RoPE etc. (its vocab_size: the target's)
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]

    @classmethod
    def for_target(cls, target: LlamaConfig, draft_vocab_size: int, num_layers: int = 1
                   ) -> Eagle3Config:
        return cls(replace(target, num_hidden_layers=num_layers, tie_word_embeddings=False),
                   draft_vocab_size, default_aux_layers(target.num_hidden_layers))

    @property
    def num_layers(self) -> int:
        """Decoder layers: `midlayer`, then `num_layers - 1` plain ones."""
        return self.llama.num_hidden_layers

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], target: LlamaConfig) -> Eagle3Config:
        layers = cfg.get("num_hidden_layers", 1)
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"num_hidden_layers must be an integer >= 1, got {layers!r}")
        fields = {"num_hidden_layers": layers, "tie_word_embeddings": False,
                  "head_dim": cfg.get("head_dim") or
                  cfg["hidden_size"] // cfg["num_attention_heads"],
                  "max_position_embeddings": cfg.get("max_position_embeddings",
                                                     target.max_position_embeddings)}
        llama = LlamaConfig.from_hf({**cfg, **fields})
        eagle = cfg.get("eagle_config") or {}
        aux = tuple(eagle.get("eagle_aux_hidden_state_layer_ids")
                    or default_aux_layers(target.num_hidden_layers))
        return cls(llama, int(cfg.get("draft_vocab_size") or cfg["vocab_size"]), aux)

    def to_hf(self) -> dict[str, Any]:
        c = self.llama
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)},
        }


class Eagle3Layer(nn.Module):
    """The head's decoder layer over [norm(embedding); norm(hidden)]."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, in_features=2 * hidden)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: Rotary,
                kv_cache: KVCache, meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        h = self.self_attn(self._input(embeds, hidden), hidden, rope, kv_cache, meta, attn)
        return self.mlp.forward_add(self.post_attention_layernorm(h), h)

    def write_kv(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: Rotary,
                 kv_cache: KVCache, meta: AttentionMetadata, attn: AttentionBackend) -> None:
        """`forward`'s cache writes only (its one layer's K/V need nothing after them)."""
        self.self_attn.write_kv(self._input(embeds, hidden), rope, kv_cache, meta, attn)

    def _input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)


class Eagle3Head(nn.Module):
    """See the module docstring. The target's embedding is shared unless the
    checkpoint brings its own."""

    def __init__(self, config: Eagle3Config, target: LlamaForCausalLM,
                 seed: int | None = 0) -> None:
        super().__init__()
        c = config.llama
        self.head_config = config
        # Acceptance per draft position as measured in training (`measured_acceptance`),
        # if the head came with it.
        self.measured_acceptance: MeasuredAcceptance | None = None
        self._target = [target]  # a list: not registered, the target stays the owner
        self.fc = nn.Linear(len(config.aux_layer_ids) * c.hidden_size, c.hidden_size,
                            bias=False)
        self.midlayer = Eagle3Layer(c)
        self.extra_layers = nn.ModuleList(LlamaDecoderLayer(c)
                                          for _ in range(config.num_layers - 1))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, config.draft_vocab_size, bias=False)
        self.mask_hidden = nn.Parameter(torch.zeros(c.hidden_size))
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.embed_tokens: nn.Embedding | None = None
        self._inv_freq: torch.Tensor | None = None
        self._rotary_table: Rotary | None = None  # every position's, once packed (CPU)
        self._fc: PackedLinear | None = None
        self._lm_head: PackedLinear | None = None
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for param in self.parameters():
                    if param.dim() == 2:
                        param.copy_(torch.randn(param.shape, generator=gen) * 0.02)

    @property
    def config(self) -> LlamaConfig:
        return self.head_config.llama

    def pack(self, kernel: LinearKernel) -> None:
        """Inference only, as `LlamaForCausalLM.pack`."""
        self._fc = kernel.pack(self.fc.weight, None)
        self.midlayer.self_attn.pack(kernel)
        self.midlayer.mlp.pack(kernel)
        for norm in (self.midlayer.input_layernorm, self.midlayer.hidden_norm,
                     self.midlayer.post_attention_layernorm, self.norm):
            norm.pack()
        for layer in self.extra_layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.pack(kernel)
        self._lm_head = kernel.pack(self.lm_head.weight, None)

    @property
    def num_layers(self) -> int:
        return self.head_config.num_layers

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose inputs the head reads."""
        return self.head_config.aux_layer_ids

    def write_context_hidden(self, out: torch.Tensor, features: torch.Tensor,
                             hidden_src: np.ndarray) -> None:
        """out [R, H]: each pass row's hidden input. A row reading the target, at
        hidden_src >= 0, gets fc(features [*, 3H] of that target-pass row); a mask row
        (MASK_ROW) the learned `mask_hidden`."""
        masks = hidden_src == MASK_ROW
        src = torch.as_tensor(np.maximum(hidden_src, 0), device=out.device)
        out[:] = self.project(features[src])
        if masks.any():  # parallel's mask rows; none in eagle's or dflash's context rows
            out[torch.as_tensor(masks, device=out.device)] = self.mask_hidden.detach()

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens or self._target[0].model.embed_tokens
        return table(token_ids)

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[R, 3H] target features -> [R, H], the hidden state of a context row."""
        x = aux_hidden.to(self.fc.weight.dtype)
        return self._fc(x) if self._fc is not None else self.fc(x)

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        """token_ids, positions [R]; hidden [R, H] (projected, or the head's own
        output) -> output hidden [R, H], before the final norm."""
        embeds, hidden, rope = self._layer_inputs(token_ids, hidden, positions)
        h = self.midlayer(embeds, hidden, rope, kv_caches[0], meta, attn)
        for layer, cache in zip(self.extra_layers, kv_caches[1:], strict=True):
            h = layer(h, rope, cache, meta, attn)
        return h

    def write_kv(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[KVCache], meta: AttentionMetadata,
                 attn: AttentionBackend) -> None:
        """A pass whose outputs nobody reads (DFlash's context pass, a prefill chunk
        that does not sample): only what `forward` writes to the cache, which is each
        layer's K/V. The last layer's attention, output projection and MLP are skipped
        (of a one-layer head, most of its work); the layers before it run whole, as
        their outputs are the next layer's input."""
        embeds, hidden, rope = self._layer_inputs(token_ids, hidden, positions)
        if not len(self.extra_layers):
            self.midlayer.write_kv(embeds, hidden, rope, kv_caches[0], meta, attn)
            return
        h = self.midlayer(embeds, hidden, rope, kv_caches[0], meta, attn)
        *before, last = self.extra_layers
        for layer, cache in zip(before, kv_caches[1:-1], strict=True):
            h = layer(h, rope, cache, meta, attn)
        assert isinstance(last, LlamaDecoderLayer)
        last.write_kv(h, rope, kv_caches[-1], meta, attn)

    def _layer_inputs(self, token_ids: torch.Tensor, hidden: torch.Tensor,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Rotary]:
        """The layer's (embeddings, hidden, rotation) for these rows, alike for
        `forward` and `write_kv`."""
        embeds = self.embed(token_ids).to(hidden.dtype)
        return embeds, hidden, self._rotary(positions, hidden.dtype)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """The rotation at these positions: on the CPU, rows of a table of every position
        `rope` gives (to ROTARY_TABLE_MAX), made at the first pass of a packed head (the
        same bits; two lookups, 31 us a pass after a cache sweep against 88 for `rope`'s
        nine ops: a /tmp timing), else `rope`'s."""
        table = self._rotary_table
        if table is None and self._lm_head is not None and positions.device.type == "cpu":
            every = torch.arange(min(self.config.max_position_embeddings, ROTARY_TABLE_MAX))
            table = self._rotary_table = Rotary.from_cos_sin(*self.rope(every, dtype))
        if (table is None or table.cos.dtype != dtype or positions.device.type != "cpu"
                or not len(positions) or int(positions.max()) >= len(table.cos)):
            return Rotary.from_cos_sin(*self.rope(positions, dtype))
        return Rotary(table.cos[positions], table.signed_sin[positions])

    def rope(self, positions: torch.Tensor, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] at these positions."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(self.config, positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> fp32 logits over the draft vocabulary."""
        return self._draft_logits(hidden).float()

    def _draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`compute_logits` in the head's dtype (what the compiled readout reads)."""
        if self._lm_head is not None:
            return self._lm_head(self.norm(hidden))
        return vocab_projection(self.norm(hidden), self.lm_head.weight)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target token ids of the greedy drafts at these rows."""
        return self.to_target_ids(greedy_ids(self.compute_logits(hidden)))

    def drafts_with_confidence(self, hidden: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`greedy_tokens` and each draft's probability under the head's distribution
        over its draft vocabulary."""
        ids, confidence = top_confidence(self._draft_logits(hidden), 1)
        return self.to_target_ids(ids[:, 0]), confidence

    def top_drafts(self, hidden: torch.Tensor, top_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's `top_k` candidates ([N, top_k] target ids, the greedy draft first)
        and the greedy draft's probability (a drafted tree, runner/draft_tree.py)."""
        ids, confidence = top_confidence(self._draft_logits(hidden), top_k)
        return self.to_target_ids(ids), confidence


def save_eagle3(head: Eagle3Head, out_dir: Path, extra: dict[str, Any] | None = None) -> None:
    """Write config.json + model.safetensors in the published layout."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = head.head_config.to_hf()
    if extra:
        config["specbudget"] = extra
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {name: t.detach().cpu().contiguous() for name, t in head.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"))


def load_eagle3(path: Path, target: LlamaForCausalLM) -> Eagle3Head:
    """A head from a checkpoint dir, strictly: every required tensor with its shape,
    optional ones as listed, nothing else."""
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    config = Eagle3Config.from_hf(cfg, target.config)
    tc = target.config
    if config.llama.hidden_size != tc.hidden_size or config.llama.vocab_size != tc.vocab_size:
        raise ValueError(f"{path}: head for hidden_size={config.llama.hidden_size}, "
                         f"vocab_size={config.llama.vocab_size}; the target has "
                         f"{tc.hidden_size}, {tc.vocab_size}")
    if max(config.aux_layer_ids) >= tc.num_hidden_layers:
        raise ValueError(f"{path}: reads target layers {config.aux_layer_ids}; the target "
                         f"has {tc.num_hidden_layers}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    head = Eagle3Head(config, target, seed=None)
    if "embed_tokens.weight" in state:
        head.embed_tokens = nn.Embedding(tc.vocab_size, tc.hidden_size)
    own = head.state_dict()
    missing = sorted(k for k in own if k not in state and k not in OPTIONAL)
    unexpected = sorted(k for k in state if k not in own and k not in OPTIONAL)
    if missing or unexpected:
        raise ValueError(f"{path}: not an EAGLE-3 head: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if name in own and tensor.shape != own[name].shape:
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(own[name].shape)}")
    head.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    head.measured_acceptance = measured_acceptance(path)
    return head.eval()


def measured_acceptance(path: Path) -> MeasuredAcceptance | None:
    """The acceptance of each draft position, given the ones before it were accepted,
    as measured when `specbudget train-drafter` wrote the head at `path`: served on
    held-out chat (`metrics.json`'s "served"; positions reached too rarely to say are
    left out), with the verifications of one round of those prompts behind it, else
    its held-out agreement (`config.json`'s "specbudget"; no verification behind it),
    else None (a head from elsewhere). The goodput policy starts from it instead of a
    generic prior; with it, how often the head's gated chains reached each draft
    (`proposal_rates`, where served with a confidence gate)."""
    try:
        served = json.loads((path / "metrics.json").read_text()).get("served") or {}
        reached = [float(a) for a in served.get("acceptance_per_position", [])]
        # Every verification at K drafts; later rounds serve the same prompts again.
        per_round = max(int(served.get("k", 1)), 1) * max(int(served.get("rounds", 1)), 1)
        verifications = int(float(served.get("draft_tokens", 0)) / per_round)
        proposals = tuple(min(max(float(p), 0.0), 1.0)
                          for p in served.get("proposal_rates", []))
        gate = float(served.get("min_draft_confidence", 0.0))
    except (OSError, ValueError, AttributeError, TypeError):
        reached, verifications, proposals, gate = [], 0, (), 0.0
    if reached and reached[0] > 0:
        chain = [1.0, *reached]
        # Each position's share of those that reached it, while enough did (a rate
        # from a few dozen drafts says little).
        rates = [b / a for a, b in pairwise(chain) if a >= 0.05]
        return MeasuredAcceptance(tuple(min(max(r, 0.0), 1.0) for r in rates),
                                  max(verifications, 0), proposals, gate)
    try:
        trained = json.loads((path / "config.json").read_text())["specbudget"]["trained"]
        agreement = [float(a) for a in trained["held_out_agreement_per_step"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    clipped = tuple(min(max(a, 0.0), 1.0) for a in agreement)
    return MeasuredAcceptance(clipped) if clipped else None
