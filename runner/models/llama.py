"""Llama-architecture decoder (SmolLM2 and any HF Llama checkpoint) over paged attention.

Inputs are flat: the step's T tokens of every request in one batch, with positions;
attention goes through an `AttentionBackend`, which writes each layer's K/V into the
paged cache and attends over it as `AttentionMetadata` describes. The model holds no
per-step state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runner.attention import AttentionBackend, AttentionMetadata
from runner.models.cpu_ops import norm_for, rope_tables_fit, rope_with_tables, torch_rms_norm
from runner.models.linear import KernelChoice, LinearKernel, PackedLinear

# Checkpoint entries that carry no weights we need (old HF saves include the RoPE table).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency-dependent RoPE rescaling ("llama3"), or plain "linear"."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture fields of an HF Llama config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def reduction_widths(self) -> tuple[int, int]:
        """The input widths the linear layers reduce over (the hidden size; the MLP's
        intermediate size, for its down projection): what a kernel is probed at."""
        return self.hidden_size, self.intermediate_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Build from a parsed HF config.json; refuses what this model cannot run."""
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (Llama uses silu)")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=_parse_rope_scaling(cfg.get("rope_scaling")),
        )


def _parse_rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", float(raw["factor"]), float(raw["low_freq_factor"]),
                           float(raw["high_freq_factor"]),
                           int(raw["original_max_position_embeddings"]))
    raise ValueError(f"rope_scaling type {kind!r} is not supported "
                     f"(supported: default, linear, llama3)")


def rope_inv_freq(config: LlamaConfig, device: torch.device) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim / 2], fp32, scaling applied."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponent)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    ramped = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    middle = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(middle, ramped, out)


def vocab_projection(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] @ weight[V, H].T for a wide vocabulary V.

    On CPU it runs as (weight @ hidden.T).T: the BLAS here is 2-4x faster with the
    vocabulary as the GEMM's long side for the few rows of a decode or verification
    step (49,152 x 576 fp32: 2-8 rows 11-17 ms against 34-41 ms as a linear; 64 rows
    51 against 82 ms), and that projection is the biggest matmul of such a step.
    """
    if hidden.device.type == "cpu":
        return torch.mm(weight, hidden.t()).t()
    return F.linear(hidden, weight)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotate_half RoPE: dims (i, i + D/2) of each head form one rotated pair.

    x [T, H, D]; cos, sin [T, 1, D] (each frequency repeated for both halves).
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class Rotary:
    """One pass's RoPE tables, made once and used by every layer: cos, and sin with
    the rotate_half sign folded in (the same maths as `apply_rope`, three ops)."""

    cos: torch.Tensor  # [T, 1, D]
    signed_sin: torch.Tensor  # [T, 1, D]: -sin on the first half, sin on the second
    # whether the compiled call reads the tables: checked once, not in every layer
    compiled: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compiled", rope_tables_fit(self.cos, self.signed_sin))

    @classmethod
    def from_cos_sin(cls, cos: torch.Tensor, sin: torch.Tensor) -> Rotary:
        half = sin.shape[-1] // 2
        return cls(cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] (any heads: q and k together). One compiled call on the CPU
        where it runs (the same bits: runner/models/cpu_ops.py)."""
        if self.compiled:
            compiled = rope_with_tables(x, self.cos, self.signed_sin)
            if compiled is not None:
                return compiled
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * self.cos, swapped, self.signed_sin)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the mean of squares in fp32 (torch's fused kernel; packed
    for inference, one compiled call on the CPU: runner/models/cpu_ops.py)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self._packed: Callable[[torch.Tensor], torch.Tensor] | None = None

    def pack(self) -> None:
        """Inference only, as the linear layers' `pack`: no gradient flows through the
        compiled norm."""
        self._packed = norm_for(self.weight.detach(), self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return self._packed(x)
        return torch_rms_norm(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    """Q/K/V projections, RoPE, paged attention through the backend, output projection."""

    def __init__(self, config: LlamaConfig, in_features: int | None = None) -> None:
        """`in_features`: the projections' input width, when not the hidden size (an
        EAGLE-3 head attends over [embedding; hidden], twice as wide)."""
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        hidden, bias = config.hidden_size, config.attention_bias
        width = in_features or hidden
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        # Inference only (`pack`): q, k and v in one matmul, and o with the residual.
        self._qkv: PackedLinear | None = None
        self._o: PackedLinear | None = None

    def pack(self, kernel: LinearKernel) -> None:
        self._qkv = kernel.pack(*_stacked((self.q_proj, self.k_proj, self.v_proj)))
        self._o = kernel.pack(self.o_proj.weight, self.o_proj.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, rope: Rotary,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        """residual + o_proj(attention(x)); x, residual [T, *] -> [T, hidden]."""
        num_tokens = x.shape[0]
        q, k, v = self._qkv_roped(x, rope)
        out = attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        if out.shape[0] < num_tokens:
            # Backends return only meta.num_actual_tokens rows; padding rows (fixed-size
            # batches) get zeros so every layer keeps T rows.
            out = F.pad(out, (0, 0, 0, 0, 0, num_tokens - out.shape[0]))
        out = out.reshape(num_tokens, -1)
        if self._o is not None:
            return self._o.add(out, residual)
        return residual + self.o_proj(out)  # [T, hidden]

    def write_kv(self, x: torch.Tensor, rope: Rotary, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 meta: AttentionMetadata, attn: AttentionBackend) -> None:
        """Only `forward`'s cache writes: the same K/V, bit for bit (the same packed
        projection and rotation), without the attention and the output projection."""
        _, k, v = self._qkv_roped(x, rope)
        attn.write(k, v, kv_cache[0], kv_cache[1], meta)

    def _qkv_roped(self, x: torch.Tensor, rope: Rotary
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) [T, Hq | Hkv, D] and v [T, Hkv, D] of x [T, *]."""
        num_tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        if self._qkv is not None:
            qkv = self._qkv(x).view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1).view(
                num_tokens, heads + 2 * kv_heads, self.head_dim)
        qk = rope(qkv[:, :heads + kv_heads])  # [T, Hq + Hkv, D]
        return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]


def _stacked(linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights (and biases) of linears sharing an input, as one [sum out, in]."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    if any(b is None for b in biases):
        return weight, None
    return weight, torch.cat([b.detach() for b in biases if b is not None])


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self._gate_up: PackedLinear | None = None
        self._down: PackedLinear | None = None

    def pack(self, kernel: LinearKernel) -> None:
        self._gate_up = kernel.pack(*_stacked((self.gate_proj, self.up_proj)))
        self._down = kernel.pack(self.down_proj.weight, self.down_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + forward(x), through the packed kernels when packed."""
        if self._gate_up is None or self._down is None:
            return residual + self.forward(x)
        gate, up = self._gate_up(x).chunk(2, dim=-1)
        return self._down.add(F.silu(gate) * up, residual)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, rope: Rotary,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), x, rope, kv_cache, meta, attn)
        return self.mlp.forward_add(self.post_attention_layernorm(h), h)

    def write_kv(self, x: torch.Tensor, rope: Rotary,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                 attn: AttentionBackend) -> None:
        """`forward`'s cache writes only (nothing after them feeds the K/V)."""
        self.self_attn.write_kv(self.input_layernorm(x), rope, kv_cache, meta, attn)

    def pack(self, kernel: LinearKernel) -> None:
        """Inference only: see `LlamaForCausalLM.pack`."""
        self.self_attn.pack(kernel)
        self.mlp.pack(kernel)
        self.input_layernorm.pack()
        self.post_attention_layernorm.pack()


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama decoder with an LM head; `forward` gives hidden states, `compute_logits`
    turns the rows the sampler needs into fp32 logits."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # RoPE frequencies, made on first use on the input's device: a plain attribute
        # (not a buffer) survives meta-device construction and dtype casts untouched.
        self._inv_freq: torch.Tensor | None = None
        self.kernel_choice: KernelChoice | None = None
        self._lm_head: PackedLinear | None = None

    def pack(self, choice: KernelChoice) -> None:
        """Prepare every linear layer for `choice.kernel` (inference only: the packed copies
        do not follow later changes to the parameters, nor carry gradients). Fuses
        q/k/v and gate/up into one matmul each and the residual adds into the kernel."""
        for layer in self.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.pack(choice.kernel)
        self.model.norm.pack()
        self._lm_head = choice.kernel.pack(self.lm_head.weight, None)
        self.kernel_choice = choice

    def tie_weights(self) -> None:
        """Share the embedding as the LM head when the config says so. Called again on
        load: materialising a meta-device model (to_empty) unties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(self.config, positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]  # [T, D/2], fp32
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return Rotary.from_cos_sin(angles.cos().to(dtype), angles.sin().to(dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-normed hidden states [T, hidden].

        kv_caches[i] = (key_cache, value_cache) of layer i, each
        [num_blocks, block_size, num_kv_heads, head_dim].
        """
        return self.forward_with_aux(input_ids, positions, kv_caches, meta, attn, ())[0]

    def forward_with_aux(self, input_ids: torch.Tensor, positions: torch.Tensor,
                         kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                         meta: AttentionMetadata, attn: AttentionBackend,
                         aux_layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, plus the inputs of the layers in `aux_layer_ids` concatenated:
        [T, len(aux_layer_ids) * hidden], what an EAGLE-3 head reads."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for "
                             f"{len(self.model.layers)} layers")
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope = self._rope(positions, x.dtype)
        aux = []
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            if i in aux_layer_ids:
                aux.append(x)
            x = layer(x, rope, kv_cache, meta, attn)
        features = torch.cat(aux, dim=-1) if aux else x[:, :0]
        return self.model.norm(x), features

    @property
    def logits_rows_per_call(self) -> int | None:
        """Rows one call of the LM head takes before it streams its weight again (None:
        any number)."""
        return None if self._lm_head is None else self._lm_head.max_rows

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in fp32 (sampling wants fp32)."""
        if self._lm_head is not None:
            return self._lm_head(hidden).float()
        return vocab_projection(hidden, self.lm_head.weight).float()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF-named state dict in, strictly: every parameter must be given once
        with its shape, and nothing else. A tied model ignores a stored lm_head.weight."""
        self.tie_weights()
        params = dict(self.named_parameters())  # a tied lm_head appears only as the embedding
        given = {name for name in state
                 if not name.endswith(_IGNORED_SUFFIXES)
                 and not (self.config.tie_word_embeddings and name == "lm_head.weight")}
        missing, unexpected = sorted(params.keys() - given), sorted(given - params.keys())
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the Llama model: "
                             f"missing {_preview(missing)}, unexpected {_preview(unexpected)}")
        with torch.no_grad():
            for name, param in params.items():
                tensor = state[name]
                if tensor.shape != param.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                                     f"model shape {tuple(param.shape)}")
                param.copy_(tensor)
        if self.kernel_choice is not None:
            self.pack(self.kernel_choice)  # the packed copies hold the old weights


def _preview(names: list[str], limit: int = 5) -> str:
    if not names:
        return "none"
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
