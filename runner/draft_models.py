"""Drafter networks: a target-conditioned head (eagle, mtp, parallel, dflash) and an
independent draft LM (draft_model, pard). Both run over their own paged KV cache,
sharing the target's block tables."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from runner.attention import AttentionBackend, AttentionMetadata
from runner.models.llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM, RMSNorm

KVCache = tuple[torch.Tensor, torch.Tensor]


class DraftHead(nn.Module):
    """EAGLE-style head: fc([embed(token); target hidden]) -> one decoder layer.

    Mask rows (parallel drafting, DFlash's query block) carry a learned hidden vector in
    place of a target hidden state. The target's embedding and LM head are shared, not
    copied. A randomly initialised head drafts poorly but keeps every pass's layout and
    the outputs lossless; trained weights load from safetensors.
    """

    def __init__(self, target: LlamaForCausalLM, seed: int = 0) -> None:
        super().__init__()
        config = target.config
        self._target = [target]  # a list: not registered, the target stays the owner
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.mask_hidden = nn.Parameter(torch.zeros(hidden))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                if param.dim() == 2:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)

    @property
    def config(self) -> LlamaConfig:
        return self._target[0].config

    @property
    def num_layers(self) -> int:
        return 1

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        """token_ids, positions [R]; hidden [R, H] -> output hidden [R, H] (pre-norm)."""
        target = self._target[0]
        embeds = target.model.embed_tokens(token_ids)  # [R, H]
        x = self.fc(torch.cat((embeds, hidden.to(embeds.dtype)), dim=-1))
        cos, sin = target._rope_cos_sin(positions, x.dtype)
        return self.layer(x, cos, sin, kv_caches[0], meta, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(self.norm(hidden))


class DraftLM(nn.Module):
    """An independent draft model of the same tokenizer (draft_model, pard)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self._model = [model]  # may be the target itself: shared weights, own KV cache

    @property
    def config(self) -> LlamaConfig:
        return self._model[0].config

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        return self._model[0](token_ids, positions, kv_caches, meta, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._model[0].compute_logits(hidden)


def load_head_weights(head: DraftHead, path: str) -> None:
    """Strictly load a head's weights from a .safetensors file or a dir holding one."""
    file = Path(path)
    if file.is_dir():
        candidates = sorted(file.glob("*.safetensors"))
        if not candidates:
            raise ValueError(f"speculative model dir {path!r} holds no *.safetensors")
        file = candidates[0]
    state = load_file(str(file))
    own = dict(head.named_parameters())
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or unexpected:
        raise ValueError(f"draft head weights in {str(file)!r} do not match: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(state[name])
