"""A token's logits do not depend on how many rows or requests share its forward pass.

Greedy speculative decoding must choose exactly the tokens plain decoding chooses, and
its verification pass computes the same positions k + 1 at a time, next to other
requests, over KV that such passes wrote. So on the real model: decode a few tokens one
pass each, then feed the same tokens as one verification pass beside another request
(a prefill and a decode), with other cache blocks, and the logits must be bitwise equal.
Broken on purpose (one ulp of attention output that depends on the rows in the pass),
the same check fails. And a prompt's last row is the same whatever chunks the prompt
was cut into: speculation's drafts take budget, so its prompts' chunks end elsewhere
than speculation off's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.tokenizer import Tokenizer
from runner.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from runner.model_loader import load_model
from runner.model_prep import resolve_model
from runner.models.kernel_select import select_linear_kernel
from runner.models.llama import LlamaForCausalLM
from tests.runner.test_cpu_attention import needs_compiler

pytestmark = pytest.mark.model  # loads the real default model

BLOCK = 16
PROMPT = "Explain in two sentences why the sky looks blue at noon but red at sunset."
OTHER = ("Summarise the following note for a busy manager: the release slipped one week "
         "because two integration tests failed on the new build machines.")


class Passes:
    """Forward passes over a paged KV cache, each request with its own blocks."""

    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend) -> None:
        cfg = model.config
        self.model, self.attn = model, attn
        self.next_block = 0
        dtype = model.lm_head.weight.dtype
        shape = (64, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                   for _ in range(cfg.num_hidden_layers)]

    def blocks(self, count: int) -> torch.Tensor:
        table = torch.arange(self.next_block, self.next_block + count, dtype=torch.int32)
        self.next_block += count
        return table

    def run(self, reqs: list[tuple[torch.Tensor, list[int], int]]) -> list[torch.Tensor]:
        """reqs: (block table, tokens, first position); the logits of every row."""
        ids, pos, slots, starts, lens = [], [], [], [0], []
        for table, tokens, first in reqs:
            for j, token in enumerate(tokens):
                p = first + j
                ids.append(token)
                pos.append(p)
                slots.append(int(table[p // BLOCK]) * BLOCK + p % BLOCK)
            starts.append(starts[-1] + len(tokens))
            lens.append(first + len(tokens))
        width = max(len(t) for t, _, _ in reqs)
        tables = torch.stack([torch.nn.functional.pad(t, (0, width - len(t))) for t, _, _ in reqs])
        meta = AttentionMetadata(
            len(ids), len(reqs), torch.tensor(starts, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32), tables, torch.tensor(slots),
            max(len(t) for _, t, _ in reqs), max(lens), starts, lens)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv, meta, self.attn)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([len(t) for _, t, _ in reqs]))


class RowCountLeaks(AttentionBackend):
    """Broken on purpose: a pass with several rows for a request moves every output by
    one ulp (what a kernel whose sums depend on the row count does)."""

    name = "leaky"

    def __init__(self) -> None:
        self.inner = get_attention_backend("torch")

    def forward(self, query, key, value, key_cache, value_cache,  # type: ignore[no-untyped-def]
                meta, scale):
        out = self.inner.forward(query, key, value, key_cache, value_cache, meta, scale)
        return torch.nextafter(out, out + 1) if meta.max_query_len > 1 else out


@pytest.fixture(scope="module", params=["auto", "bfloat16", "int8"])
def model(request: pytest.FixtureRequest) -> Iterator[LlamaForCausalLM]:
    from runner.config import RunnerConfig

    quantization = "int8" if request.param == "int8" else None
    config = RunnerConfig(dtype="auto" if quantization else request.param,
                          quantization=quantization)
    loaded = load_model(resolve_model(None), config.torch_dtype)
    cfg = loaded.config
    loaded.pack(select_linear_kernel(config.torch_dtype, "cpu",
                                     (cfg.hidden_size, cfg.intermediate_size),
                                     quantization))
    yield loaded


@pytest.fixture(scope="module")
def prompts() -> tuple[list[int], list[int]]:
    tok = Tokenizer.from_dir(resolve_model(None))
    return tok.encode(PROMPT), tok.encode(OTHER)


def _decode_then_verify(model: LlamaForCausalLM, attn: AttentionBackend,
                        prompts: tuple[list[int], list[int]], steps: int = 6
                        ) -> tuple[list[torch.Tensor], torch.Tensor]:
    prompt, other = prompts
    # Plain decoding: the prompt, then one token per pass.
    plain = Passes(model, attn)
    table = plain.blocks(8)
    logits = plain.run([(table, prompt, 0)])[0][-1:]
    tokens, decoded = [int(logits.argmax())], []
    for i in range(steps):
        decoded.append(plain.run([(table, [tokens[-1]], len(prompt) + i)])[0])
        tokens.append(int(decoded[-1].argmax()))
    # Verification: the same prompt beside another request's prefill, then the decoded
    # tokens as one pass of drafts beside that request's decode, in other blocks.
    spec = Passes(model, attn)
    other_table, table = spec.blocks(8), spec.blocks(8)
    spec.run([(other_table, other, 0), (table, prompt, 0)])
    verified = spec.run([(table, tokens[:steps], len(prompt)),
                         (other_table, [7], len(other))])[0]
    return decoded, verified


# The CPU runtime's compiled kernel, and its fallback.
BACKENDS = [pytest.param("cpu", marks=needs_compiler), "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_verification_rows_equal_one_row_decodes(
        model: LlamaForCausalLM, prompts: tuple[list[int], list[int]], backend: str) -> None:
    decoded, verified = _decode_then_verify(model, get_attention_backend(backend), prompts)
    assert model.kernel_choice is not None and model.kernel_choice.row_invariant
    for i, row in enumerate(decoded):
        assert torch.equal(row[0], verified[i]), (
            f"{model.lm_head.weight.dtype}: row {i} differs by "
            f"{(row[0] - verified[i]).abs().max().item():.3g}")


def _last_row(model: LlamaForCausalLM, attn: AttentionBackend, prompt: list[int],
              chunks: list[int]) -> torch.Tensor:
    passes = Passes(model, attn)
    table, first, logits = passes.blocks(16), 0, torch.empty(0)
    for size in chunks:
        logits = passes.run([(table, prompt[first:first + size], first)])[0]
        first += size
    assert first == len(prompt)
    return logits[-1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prompts_last_row_is_the_same_however_it_was_chunked(
        model: LlamaForCausalLM, prompts: tuple[list[int], list[int]], backend: str) -> None:
    # 215 tokens: long chunks (over BATCHED_MAX_QUERY rows) and short tails, past the
    # 193 keys where this machine's BLAS splits a sum.
    prompt = (prompts[0] + prompts[1]) * 5
    size = len(prompt)
    whole = _last_row(model, get_attention_backend(backend), prompt, [size])
    for chunks in ([40, size - 40], [size - 20, 20], [size - 1, 1], [128, 33, size - 161]):
        row = _last_row(model, get_attention_backend(backend), prompt, chunks)
        assert torch.equal(whole, row), (
            f"{model.lm_head.weight.dtype}, chunks {chunks}: the last row differs by "
            f"{(whole.float() - row.float()).abs().max().item():.3g}")


def test_the_check_fails_when_rows_depend_on_the_pass(
        model: LlamaForCausalLM, prompts: tuple[list[int], list[int]]) -> None:
    decoded, verified = _decode_then_verify(model, RowCountLeaks(), prompts, steps=2)
    assert not all(torch.equal(row[0], verified[i]) for i, row in enumerate(decoded))
