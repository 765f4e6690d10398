"""The independent draft LM (draft_model, pard): a model of the target's tokenizer over
its own paged KV cache, sharing the target's block tables. The target-conditioned
head (eagle, mtp, parallel, dflash) is `runner/eagle3.py`."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from runner.attention import AttentionBackend, AttentionMetadata
from runner.models.llama import LlamaConfig, LlamaForCausalLM
from spec_decode.sampling import greedy_ids, greedy_with_confidence, top_with_confidence

KVCache = tuple[torch.Tensor, torch.Tensor]


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

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Empty: a draft LM reads tokens only, no target features."""
        return ()

    def write_context_hidden(self, out: torch.Tensor, features: torch.Tensor,
                             hidden_src: np.ndarray) -> None:
        """Nothing to write: `forward` ignores its hidden input."""

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        return self._model[0](token_ids, positions, kv_caches, meta, attn)

    def write_kv(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[KVCache], meta: AttentionMetadata,
                 attn: AttentionBackend) -> None:
        """The whole forward: each layer's K/V read the layer before it."""
        self.forward(token_ids, hidden, positions, kv_caches, meta, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._model[0].compute_logits(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return greedy_ids(self.compute_logits(hidden))

    def drafts_with_confidence(self, hidden: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`greedy_tokens` and each draft's probability under the draft LM."""
        return greedy_with_confidence(self.compute_logits(hidden))

    def top_drafts(self, hidden: torch.Tensor, top_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's `top_k` candidates, the greedy draft first, and its probability."""
        return top_with_confidence(self.compute_logits(hidden), top_k)
