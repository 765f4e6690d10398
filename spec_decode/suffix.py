"""Suffix decoding (`suffix`): drafts from suffix trees over earlier tokens.

SuffixDecoding (Oliaro et al. 2024; Arctic Inference, vLLM's `suffix` method) keeps
two trees of token counts:

- one per request over its own tokens (prompt + outputs), extended as tokens arrive;
- one global tree over the responses of earlier finished requests, capped at
  `max_cached_requests` responses (the oldest is evicted first).

Each tree is a trie of every suffix of its sequences cut at `max_depth` tokens, where
a node's `count` is how many times its path occurs. To propose, every suffix of the
context of length m < max_depth that exists in a tree is a candidate start; from there
the walk follows the most frequent child, whose probability is its share of the
parent's continuations, while the product of those shares (the path probability)
stays >= `min_token_prob`. A walk drafts at most min(k, m * max_spec_factor) tokens:
short matches are weak evidence. Its score, the sum of the path probabilities, is the
expected number of accepted drafts; the best score wins, the request's own tree and
then the longer match winning ties. So the draft count varies per step, 0 to k.

Costs (D = max_depth, n = tokens indexed):
- appending one token: O(D) dict operations (D open suffixes each step down a child);
- memory: O(n * D) nodes in the worst case (most substrings longer than a few tokens
  are unique), about 80 bytes each in CPython: ~1.7 KiB per token at D = 24, so ~7 MB
  for a 4k-token request; lower D to shrink it;
- propose: O(D^2) lookups to match the context in the global tree, plus O(D * k) for the
  walks; the request's own tree needs no matching (its open suffixes are the matches);
- finishing a request: O(len * D) to insert its response, the same to evict one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from spec_decode.proposer import TokenProposer
from spec_decode.settings import MethodSettings

DEFAULT_MAX_TREE_DEPTH = 24
DEFAULT_MAX_CACHED_REQUESTS = 256
DEFAULT_MIN_TOKEN_PROB = 0.1
DEFAULT_MAX_SPEC_FACTOR = 1.0


class SuffixNode:
    """One trie node: the path from the root to it is a token string.

    `count`: occurrences of the path; `total`: occurrences followed by another token
    (the sum of the children's counts), the denominator of a child's probability;
    `best`: the child with the highest count (the first to reach it wins ties).
    Most nodes lie on chains of unique substrings and have one child at most, so
    `children` stays None until a second child appears (the only child is `best`):
    that saves a dict per node, about three quarters of the tree's memory.
    """

    __slots__ = ("best", "children", "count", "token", "total")

    def __init__(self, token: int) -> None:
        self.token = token
        self.count = 0
        self.total = 0
        self.children: dict[int, SuffixNode] | None = None
        self.best: SuffixNode | None = None

    def child(self, token: int) -> SuffixNode | None:
        if self.children is not None:
            return self.children.get(token)
        best = self.best
        return best if best is not None and best.token == token else None

    def child_nodes(self) -> list[SuffixNode]:
        if self.children is not None:
            return list(self.children.values())
        return [] if self.best is None else [self.best]


class SuffixTree:
    """Counts of every substring of up to `max_depth` tokens of the sequences added.

    A sequence being extended is tracked by its *open suffixes*: `open_nodes[i]` is the
    node of its last i tokens, for i = 0 (the root) .. min(len, max_depth - 1).
    Appending token t steps each one down to its child t, so every substring ending at
    t is counted once.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = SuffixNode(-1)

    def append(self, open_nodes: list[SuffixNode], token: int) -> list[SuffixNode]:
        """Count `token` after the open suffixes; returns the new open suffixes."""
        extended = [self.root]
        for node in open_nodes:  # SuffixNode.child inlined: this loop is the hot path
            best = node.best
            if node.children is not None:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = SuffixNode(token)
            elif best is not None and best.token == token:
                child = best
            else:
                child = SuffixNode(token)
                if best is not None:  # a second child: now they need a dict
                    node.children = {best.token: best, token: child}
            child.count += 1
            node.total += 1
            if best is None or child.count > best.count:
                node.best = child
            extended.append(child)
        if len(extended) > self.max_depth:
            extended.pop()  # a path of max_depth tokens is never extended
        return extended

    def extend(self, open_nodes: list[SuffixNode], tokens: Sequence[int]) -> list[SuffixNode]:
        """`append` each of `tokens` in order; returns the new open suffixes."""
        for token in tokens:
            open_nodes = self.append(open_nodes, token)
        return open_nodes

    def insert(self, tokens: Sequence[int]) -> None:
        """Count every substring of `tokens` (a whole sequence at once)."""
        self.extend([self.root], tokens)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `insert(tokens)`: uncount its substrings, dropping nodes that reach 0."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                child = node.child(token)
                assert child is not None, "SuffixTree.remove of a sequence never inserted"
                child.count -= 1
                node.total -= 1
                if child.count == 0 and node.children is not None:
                    del node.children[token]  # its subtree's counts are all 0 too
                if node.best is child:
                    if node.children is None:  # it was the only child
                        node.best = child if child.count > 0 else None
                    else:
                        node.best = max(node.children.values(), key=_count, default=None)
                if child.count == 0:
                    break
                node = child

    def match(self, context: Sequence[int]) -> list[SuffixNode]:
        """Nodes of the context's suffixes that exist, shortest first (index m - 1 holds
        the last m tokens), for m < max_depth; O(max_depth^2) dict lookups.

        A longer suffix can exist only if every shorter one does, so the first miss ends it.
        """
        nodes: list[SuffixNode] = []
        for m in range(1, min(len(context), self.max_depth - 1) + 1):
            node = self.root
            for token in context[len(context) - m:]:
                child = node.child(token)
                if child is None:
                    return nodes
                node = child
            nodes.append(node)
        return nodes


def _count(node: SuffixNode) -> int:
    return node.count


def walk(node: SuffixNode, limit: int, min_token_prob: float) -> tuple[float, list[int]]:
    """Greedy path below `node`: (score, drafts), at most `limit` drafts.

    Follows the most frequent child while the path probability (product of each step's
    share) stays >= min_token_prob; score = sum of the path probabilities after each
    draft, the expected number accepted if drafts were accepted with those odds.
    Shares [1.0, 0.5, 0.4] with min_token_prob 0.1 -> probabilities [1.0, 0.5, 0.2],
    score 1.7; with 0.3 the third draft is dropped (0.2 < 0.3), score 1.5.
    """
    drafts: list[int] = []
    prob, score = 1.0, 0.0
    while len(drafts) < limit:
        child = node.best
        if child is None:
            break
        prob *= child.count / node.total
        if prob < min_token_prob:
            break
        drafts.append(child.token)
        score += prob
        node = child
    return score, drafts


@dataclass
class _RequestState:
    """A request's own tree and what the global tree will get when it finishes."""

    tree: SuffixTree
    open_nodes: list[SuffixNode]
    num_tokens: int          # tokens folded into `tree` so far
    response: list[int]      # the last max_depth - 1 start tokens, then every later one
    num_start_tail: int      # how many leading entries of `response` are start tokens


@dataclass(frozen=True)
class SuffixOptions:
    """SuffixProposer settings, read from `SpeculativeConfig.options` (vLLM's names)."""

    max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH
    max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS
    min_token_prob: float = DEFAULT_MIN_TOKEN_PROB
    max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR

    def __post_init__(self) -> None:
        if self.max_tree_depth < 2:
            raise ValueError("suffix option max_tree_depth must be >= 2 (one context token "
                             f"and one draft; got {self.max_tree_depth})")
        if self.max_cached_requests < 0:
            raise ValueError("suffix option max_cached_requests must be >= 0 (0 turns the "
                             f"global tree off; got {self.max_cached_requests})")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError("suffix option min_token_prob must be in [0, 1] "
                             f"(got {self.min_token_prob})")
        if self.max_spec_factor <= 0.0:
            raise ValueError("suffix option max_spec_factor must be > 0 "
                             f"(got {self.max_spec_factor})")


class SuffixProposer(TokenProposer):
    """Suffix decoding over each request's own tokens plus earlier finished responses.

    Token updates come from the delta: `propose` receives all known tokens and folds in
    those beyond what the request's tree has seen. A `propose` for a request id never
    added (or removed) adds it on the spot with the given tokens as its start, so a
    runner may drive this proposer like the stateless `NgramProposer`.

    The global tree gets, at `remove_request(finished=True)`, the response tokens seen
    by the last `propose` (tokens sampled after it are never passed in), preceded by
    the last max_tree_depth - 1 tokens the request started with, so a new request
    ending with the same prompt tail is offered the response's opening. After a
    preemption (`finished=False`) the request's tree is dropped and nothing is
    inserted; on resumption its start is prompt plus earlier outputs.
    """

    def __init__(self, options: SuffixOptions | None = None) -> None:
        self.options = options or SuffixOptions()
        self._requests: dict[str, _RequestState] = {}
        # Start tokens of requests whose tree waits for their first draft (`add_request`).
        self._starts: dict[str, list[int]] = {}
        self._global = SuffixTree(self.options.max_tree_depth)
        self._responses: OrderedDict[str, list[int]] = OrderedDict()  # oldest first

    @classmethod
    def from_config(cls, cfg: MethodSettings) -> SuffixProposer:
        """Build from `cfg.options` (`max_tree_depth`, `max_cached_requests`,
        `min_token_prob`, `max_spec_factor`); other keys are left to other parts."""
        names = ("max_tree_depth", "max_cached_requests", "min_token_prob", "max_spec_factor")
        return cls(SuffixOptions(**{key: cfg.options[key] for key in names
                                    if key in cfg.options}))

    @property
    def cached_response_ids(self) -> list[str]:
        """Ids of the finished requests whose responses the global tree holds, oldest first."""
        return list(self._responses)

    @property
    def global_tree(self) -> SuffixTree:
        return self._global

    def add_request(self, req_id: str, token_ids: np.ndarray) -> None:
        """Keep the request's start tokens; their tree of its own is built at its first
        `propose`. A request the draft policy parks may never draft, and building a
        tree costs ~2.7 ms per 80 start tokens (measured alone; a few times that in
        place): at 16 running that alone cost suffix ~5 % of speculation off's speed
        where it drafted nothing. Built later from the same tokens, the tree is the
        same, and so are the drafts."""
        self._requests.pop(req_id, None)
        self._starts[req_id] = np.asarray(token_ids).tolist()

    def _build(self, req_id: str, tokens: list[int]) -> _RequestState:
        """Index the request's start tokens in a fresh tree of its own."""
        tree = SuffixTree(self.options.max_tree_depth)
        open_nodes = tree.extend([tree.root], tokens)
        tail = tokens[max(0, len(tokens) - (self.options.max_tree_depth - 1)):]
        state = _RequestState(tree, open_nodes, len(tokens), tail, len(tail))
        self._requests[req_id] = state
        return state

    def remove_request(self, req_id: str, finished: bool) -> None:
        """Drop the request's tree; a finished one's response joins the global tree (one
        that never drafted has no response seen: nothing to learn from)."""
        self._starts.pop(req_id, None)
        state = self._requests.pop(req_id, None)
        if state is None or not finished or self.options.max_cached_requests == 0:
            return
        if len(state.response) == state.num_start_tail:
            return  # no output seen: nothing to learn from
        if req_id in self._responses:  # a reused id: its newer response replaces the old
            self._global.remove(self._responses.pop(req_id))
        self._global.insert(state.response)
        self._responses[req_id] = state.response
        while len(self._responses) > self.options.max_cached_requests:
            _, oldest = self._responses.popitem(last=False)
            self._global.remove(oldest)

    def propose(self, req_id: str, token_ids: np.ndarray, k: int) -> list[int]:
        """Up to k drafts: the best-scoring walk over the own and global trees."""
        state = self._requests.get(req_id)
        if state is None:
            start = self._starts.pop(req_id, None)
            state = self._build(req_id, start if start is not None
                                else np.asarray(token_ids).tolist())
        self._fold_in(req_id, state, token_ids)
        if k <= 0:
            return []
        best_score, best = 0.0, []
        # Own tree: its open suffixes are the matches (open_nodes[m]: the last m tokens).
        for nodes in (state.open_nodes[1:], self._global_matches(token_ids)):
            score, drafts = self._best_walk(nodes, k)
            if score > best_score:
                best_score, best = score, drafts
        return best

    def _fold_in(self, req_id: str, state: _RequestState, token_ids: np.ndarray) -> None:
        num_tokens = len(token_ids)
        if num_tokens < state.num_tokens:
            raise ValueError(f"SuffixProposer.propose({req_id!r}): got {num_tokens} tokens but "
                             f"already indexed {state.num_tokens}; known tokens only grow "
                             "(call add_request to restart a request)")
        new_tokens: list[int] = np.asarray(token_ids[state.num_tokens:]).tolist()
        state.open_nodes = state.tree.extend(state.open_nodes, new_tokens)
        state.response.extend(new_tokens)
        state.num_tokens = num_tokens

    def _global_matches(self, token_ids: np.ndarray) -> list[SuffixNode]:
        if not self._responses:
            return []
        start = max(0, len(token_ids) - (self.options.max_tree_depth - 1))
        context: list[int] = np.asarray(token_ids[start:]).tolist()
        return self._global.match(context)

    def _best_walk(self, nodes: list[SuffixNode], k: int) -> tuple[float, list[int]]:
        """Best (score, drafts) over matches `nodes` (nodes[m - 1]: last m tokens),
        trying the longest match first so it wins ties."""
        opts = self.options
        best_score, best = 0.0, []
        for m in range(len(nodes), 0, -1):
            node = nodes[m - 1]
            limit = min(k, int(m * opts.max_spec_factor + 1e-6))
            if node.total == 0 or limit <= 0:
                continue
            score, drafts = walk(node, limit, opts.min_token_prob)
            if score > best_score:
                best_score, best = score, drafts
        return best_score, best
