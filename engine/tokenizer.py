"""Tokenizer of an HF-style checkpoint dir: tokenizer.json + tokenizer_config.json."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from scheduler.kv_cache_manager import cdiv


def _raise_exception(message: str) -> None:
    """Templates call `raise_exception(msg)` to reject a conversation (as in HF)."""
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # HF's version: keeps non-ASCII as is (jinja's built-in escapes it for HTML).
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for bytes, char -> byte (GPT-2's scheme):
    printable Latin-1 bytes stand for themselves, the other 68 bytes take the code
    points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1),
                 *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


BYTE_OF_CHAR = _byte_level_alphabet()


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value["content"])
    return str(value) if value is not None else None


def _added_ids(tokenizer: HFTokenizer) -> list[int]:
    getter = getattr(tokenizer, "get_added_tokens_decoder", None)
    return list(getter()) if getter is not None else []


class Tokenizer:
    """`tokenizers.Tokenizer` plus the special tokens and chat template from the config."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self._template: Template | None = None  # compiled on first use
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._special_ids = set(_added_ids(tokenizer))
        self._max_token_bytes: int | None = None  # found on first use

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found (only the `tokenizers` JSON "
                                    f"format is supported)")
        config_file = path / "tokenizer_config.json"
        config = (json.loads(config_file.read_text(encoding="utf-8"))
                  if config_file.is_file() else {})
        return cls(HFTokenizer.from_file(str(tok_file)), config)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it map to their ids.

        `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS), if any.
        Through `encode_batch`, which releases the GIL: a long prompt tokenised on a
        worker thread then never stalls the server's event loop or the engine thread.
        """
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for; a byte-level token may hold part of a
        UTF-8 character, which decoding alone would turn into U+FFFD."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and token_id not in self._special_ids \
                and all(c in BYTE_OF_CHAR for c in piece):
            return bytes(BYTE_OF_CHAR[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        return self.decode([token_id], skip_special_tokens=False).encode()

    def logprob_token(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or, for a token holding part of a UTF-8
        character, "bytes:\\xNN..." as vLLM writes it (decoding would give U+FFFD, and
        several such tokens would collide as one key)."""
        raw = self.token_bytes(token_id)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
        return self.decode([token_id], skip_special_tokens=False)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), found without tokenising: no token covers
        more than `max_token_bytes` bytes. 0 where a normalizer may reshape the text."""
        if self._tok.normalizer is not None:
            return 0
        if self._max_token_bytes is None:
            self._max_token_bytes = max(len(self.token_bytes(i)) for i in range(self.vocab_size))
        return cdiv(len(text.encode("utf-8", "replace")), self._max_token_bytes)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` ([{"role", "content"}, ...]) with the checkpoint's template."""
        return self._compiled_template().render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def _compiled_template(self) -> Template:
        if self._template is None:
            if not self.chat_template:
                raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
            # Same environment options as HF transformers, so templates render identically.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template
