"""Incremental detokenization with stop strings, identical streamed or not."""

from __future__ import annotations

from engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # a byte-level BPE token that ends mid-character decodes to this


class IncrementalDetokenizer:
    """Turns each step's new token ids into new text, and finds stop strings.

    Decodes only a short window (from `prefix_offset`) each step, as HF's streamers and
    vLLM do, and holds text back while its last character is incomplete. Text that
    could still turn into a stop string is held back too (up to the longest stop string
    minus one character), so streamed text always equals the final text.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0  # characters of `text` already handed out
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: list[int]) -> int | None:
        """Add tokens one at a time. None while no stop string is found; else how many
        of `new_ids` were taken: the stop string ended with the last of them, the text
        is cut before it and the later tokens are dropped (a verification step can
        emit several tokens past a stop string; speculation off would never have made
        them, so usage and logprobs must not count them either)."""
        for taken, token_id in enumerate(new_ids, start=1):
            if self._push_one(token_id):
                return taken
        return None

    def _push_one(self, token_id: int) -> bool:
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if full.endswith(REPLACEMENT):
            return False  # an incomplete character: wait for the next token
        start = len(self.text)
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return self._check_stop(start)

    def _check_stop(self, start: int) -> bool:
        if not self.stop:
            return False
        window_start = max(0, start - self._hold)
        hits = [i for i in (self.text.find(s, window_start) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        return True

    def take(self, final: bool) -> str:
        """New text to hand out; holds back a possible stop-string prefix until final."""
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
