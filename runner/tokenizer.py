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


def _raise_exception(message: str) -> None:
    """Templates call `raise_exception(msg)` to reject a conversation (as in HF)."""
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # HF's version: keeps non-ASCII as is (jinja's built-in escapes it for HTML).
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value["content"])
    return str(value) if value is not None else None


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
        """
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

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
