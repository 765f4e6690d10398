"""Target features for training, computed through the same paged forward the runner
uses, so a head learns from exactly the hidden states it will read when serving."""

from __future__ import annotations

import torch

from runner.attention import AttentionMetadata, get_attention_backend
from runner.config import RunnerConfig
from runner.models.llama import LlamaForCausalLM
from scheduler.kv_cache_manager import cdiv

BLOCK = 16
# Rows whose logits are made at once for the greedy labels: a whole chunk of windows
# (2,048 rows) made [2048, 49152] float32 logits, 400 MB written and read back; 256
# rows' (50 MB) at a time took ~0.7 of the time (README). The same argmax.
LABEL_ROWS = 256


@torch.inference_mode()
def target_features(model: LlamaForCausalLM, windows: torch.Tensor,
                    aux_layer_ids: tuple[int, ...], dtype: torch.dtype = torch.float16
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """windows [N, T] token ids -> (aux [N, T, len(ids)·H] in `dtype` (fp16 halves
    the memory of a training set), labels [N, T], final [N, T, H] the final normed
    hidden states in `dtype`, from which the LM head gives the target's distribution).

    labels[i, t] is the target's greedy prediction after tokens [0, t] of window i:
    the token the drafter should propose for position t + 1.
    """
    num, length = windows.shape
    cfg = model.config
    device = model.lm_head.weight.device
    model_dtype = model.lm_head.weight.dtype
    blocks_per = cdiv(length, BLOCK)
    shape = (num * blocks_per, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, dtype=model_dtype, device=device),
           torch.zeros(shape, dtype=model_dtype, device=device))
          for _ in range(cfg.num_hidden_layers)]
    positions = torch.arange(length, device=device).repeat(num)
    block_table = torch.arange(num * blocks_per, dtype=torch.int32,
                               device=device).view(num, blocks_per)
    req = torch.arange(num, device=device).repeat_interleave(length)
    slots = block_table[req, positions // BLOCK].long() * BLOCK + positions % BLOCK
    starts = [i * length for i in range(num + 1)]
    meta = AttentionMetadata(
        num_actual_tokens=num * length, num_reqs=num,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.full((num,), length, dtype=torch.int32, device=device),
        block_table=block_table, slot_mapping=slots, max_query_len=length,
        max_seq_len=length, query_start_loc_cpu=starts, seq_lens_cpu=[length] * num)
    # The attention the runner serves this model with ("auto"), so these features are
    # the ones generation captures and serving feeds the head.
    backend = RunnerConfig(device=device.type,
                           dtype=str(model_dtype).removeprefix("torch.")).backend_name
    hidden, aux = model.forward_with_aux(windows.reshape(-1).to(device), positions, kv, meta,
                                         get_attention_backend(backend), aux_layer_ids)
    labels = greedy_labels(model, hidden)
    return (aux.to(dtype).view(num, length, -1).cpu(), labels.view(num, length).cpu(),
            hidden.to(dtype).view(num, length, -1).cpu())


def greedy_labels(model: LlamaForCausalLM, hidden: torch.Tensor, rows: int = LABEL_ROWS
                  ) -> torch.Tensor:
    """The target's argmax token after each row of `hidden` [T, H], `rows` at a time."""
    return torch.cat([model.compute_logits(part).argmax(dim=-1)
                      for part in hidden.split(rows)])
