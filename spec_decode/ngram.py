"""Prompt lookup decoding (`ngram`): drafts copied from the request's own earlier tokens.

For n from `max_n` down to `min_n`, find the most recent earlier occurrence of the
context's last n tokens and propose the (up to k) tokens that followed it. The longest
n that occurs wins; among its occurrences the most recent one wins, because recent text
is the likeliest to be repeated next (code being edited, a list being continued).

Cost per call is bounded: only the last `max_window` tokens are searched, with one
vectorised comparison over the window and then filters over the surviving candidates,
O(max_window + max_n * matches) numpy work and a Python loop over n only.
"""

from __future__ import annotations

import numpy as np

from spec_decode.proposer import TokenProposer
from spec_decode.settings import MethodSettings

DEFAULT_MAX_WINDOW = 4096


def find_ngram_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix
    n-gram of `tokens` (min_n <= n <= max_n); [] when no such n-gram recurs.

    An occurrence is named by its end position j (its last token is tokens[j]); it is
    "earlier" when j <= len - 2, so at least one token follows it.
    """
    num_tokens = tokens.shape[0]
    if k <= 0 or num_tokens < min_n + 1:
        return []
    # Ends of the 1-gram matches: every earlier position holding the last token.
    # tokens = [5, 7, 5, 7, 5] -> ends = [0, 2]
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    best_end, best_n = -1, 0
    for n in range(1, max_n + 1):
        if n > 1:
            # Keep the ends whose match also extends one token further back:
            # n = 2 compares tokens[j - 1] with tokens[-2]; ends = [0, 2] -> [2].
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[num_tokens - n]]
        if ends.size == 0:
            break
        if n >= min_n:
            best_end, best_n = int(ends[-1]), n  # ends ascend: the last is the most recent
    if best_n == 0:
        return []
    out: list[int] = tokens[best_end + 1:best_end + 1 + k].tolist()
    return out


class NgramProposer(TokenProposer):
    """Prompt lookup decoding over each request's own tokens; keeps no per-request state.

    `min_n`/`max_n` bound the n-gram sizes tried (SpeculativeConfig's
    `prompt_lookup_min/max`); `max_window` bounds how many trailing tokens are searched
    (option `max_window`, default 4096), so a step's cost does not grow with the context.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4,
                 max_window: int = DEFAULT_MAX_WINDOW) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramProposer needs 1 <= min_n <= max_n (got {min_n}, {max_n})")
        if max_window < max_n + 1:
            raise ValueError(f"NgramProposer.max_window must be >= max_n + 1 = {max_n + 1} "
                             f"(got {max_window}): a match needs a token after it")
        self.min_n = min_n
        self.max_n = max_n
        self.max_window = max_window

    @classmethod
    def from_config(cls, cfg: MethodSettings) -> NgramProposer:
        """Build from `prompt_lookup_min/max` and the option `max_window`."""
        return cls(cfg.prompt_lookup_min, cfg.prompt_lookup_max,
                   int(cfg.options.get("max_window", DEFAULT_MAX_WINDOW)))

    def propose(self, req_id: str, token_ids: np.ndarray, k: int) -> list[int]:
        """Up to k drafts copied from after the best earlier match (see module doc)."""
        window = np.asarray(token_ids)[-self.max_window:]
        return find_ngram_continuation(window, self.min_n, self.max_n, k)
