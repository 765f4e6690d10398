"""A drafter pass that reads out no draft (DFlash's context pass, a prefill chunk that
does not sample) runs only its KV writes (`write_kv`): the caches must come out bit for
bit as the full forward leaves them, on every CPU attention backend, packed or not,
or the drafts of every later pass would change."""

from __future__ import annotations

import pytest
import torch

from runner.attention import AttentionMetadata, get_attention_backend
from runner.draft_models import DraftLM
from runner.eagle3 import Eagle3Config, Eagle3Head
from runner.models.llama import LlamaConfig, LlamaForCausalLM
from tests.helpers import kernel_that_packs

BLOCK = 16
ROWS = (5, 2)  # two requests' rows in the pass
START = (3, 0)  # the positions each starts at (request 0 has cached rows before it)


def tiny_target(dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig.from_hf({
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_theta": 10000.0, "tie_word_embeddings": True})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model.to(dtype).eval()


def pass_meta() -> AttentionMetadata:
    seq_lens = [s + r for s, r in zip(START, ROWS, strict=True)]
    positions = torch.cat([torch.arange(s, s + r) for s, r in zip(START, ROWS, strict=True)])
    block_table = torch.tensor([[0], [1]], dtype=torch.int32)
    request = torch.repeat_interleave(torch.arange(2), torch.tensor(ROWS))
    slots = block_table[request, 0].long() * BLOCK + positions
    starts = [0, ROWS[0], sum(ROWS)]
    return AttentionMetadata(
        num_actual_tokens=sum(ROWS), num_reqs=2,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=block_table,
        slot_mapping=slots, max_query_len=max(ROWS), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)


def caches(layers: int, config: LlamaConfig, dtype: torch.dtype
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded caches: the rows before a request's pass hold earlier K/V."""
    gen = torch.Generator().manual_seed(1)
    shape = (2, BLOCK, config.num_key_value_heads, config.head_dim)
    return [(torch.randn(shape, generator=gen).to(dtype),
             torch.randn(shape, generator=gen).to(dtype)) for _ in range(layers)]


def both_ways(net: torch.nn.Module, layers: int, config: LlamaConfig, backend: str,
              dtype: torch.dtype) -> tuple[list, list]:
    """The caches after `net`'s full forward and after its `write_kv`, from the same
    start, for the same pass."""
    meta, attn = pass_meta(), get_attention_backend(backend)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (sum(ROWS),), generator=gen)
    hidden = torch.randn(sum(ROWS), config.hidden_size, generator=gen).to(dtype)
    positions = torch.cat([torch.arange(s, s + r) for s, r in zip(START, ROWS, strict=True)])
    full, written = caches(layers, config, dtype), caches(layers, config, dtype)
    with torch.inference_mode():
        net(ids, hidden, positions, full, meta, attn)
        net.write_kv(ids, hidden, positions, written, meta, attn)
    return full, written


def assert_same(full: list, written: list, fresh: list) -> None:
    for (k_full, v_full), (k_w, v_w), (k_0, _) in zip(full, written, fresh, strict=True):
        assert not torch.equal(k_full, k_0)  # the pass wrote something
        assert torch.equal(k_full, k_w) and torch.equal(v_full, v_w)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_head_write_only_pass_writes_the_full_pass_kv(backend: str, packed: bool,
                                                      layers: int) -> None:
    """Every layer's cache, a deeper head's too (its layers before the last run whole:
    their outputs are the next one's input)."""
    dtype = torch.bfloat16 if packed else torch.float32
    target = tiny_target(dtype)
    head = Eagle3Head(Eagle3Config.for_target(target.config, 32, layers), target,
                      seed=3).to(dtype)
    if packed:
        head.pack(kernel_that_packs(dtype))
    full, written = both_ways(head, layers, target.config, backend, dtype)
    assert_same(full, written, caches(layers, target.config, dtype))


def test_draft_lm_write_only_pass_writes_every_layer() -> None:
    """A draft LM's layers each read the one before, so its write-only pass is its
    whole forward: every layer's cache as the forward leaves it."""
    target = tiny_target(torch.float32)
    full, written = both_ways(DraftLM(target), 3, target.config, "torch", torch.float32)
    assert_same(full, written, caches(3, target.config, torch.float32))
