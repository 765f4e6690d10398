"""Model-free proposers: prompt lookup (`ngram`) and suffix decoding (`suffix`), each
checked on hand-made cases and against a brute-force reference written here."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec_decode import SpeculativeConfig
from spec_decode.ngram import NgramProposer
from spec_decode.suffix import SuffixNode, SuffixOptions, SuffixProposer, SuffixTree


def arr(tokens: list[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


# ---- ngram: brute-force reference ---------------------------------------------------


def reference_ngram(tokens: list[int], min_n: int, max_n: int, k: int,
                    max_window: int) -> list[int]:
    """The rule spelled out: longest n first, then the most recent earlier match."""
    window = tokens[-max_window:]
    size = len(window)
    for n in range(max_n, min_n - 1, -1):
        pattern = window[size - n:]
        for start in range(size - n - 1, -1, -1):  # most recent first; a token must follow
            if window[start:start + n] == pattern:
                return window[start + n:start + n + k]
    return []


# ---- ngram: hand-made cases ---------------------------------------------------------


def test_ngram_proposes_the_continuation_of_a_repeated_phrase() -> None:
    proposer = NgramProposer(1, 3)
    assert proposer.propose("r", arr([1, 2, 3, 4, 5, 9, 1, 2, 3]), k=2) == [4, 5]


def test_ngram_prefers_the_longest_n() -> None:
    # "3" alone last occurred before 11; the longer "2 3" occurred before 10.
    tokens = arr([1, 2, 3, 10, 5, 3, 11, 2, 3])
    assert NgramProposer(1, 3).propose("r", tokens, k=3) == [10, 5, 3]
    assert NgramProposer(1, 1).propose("r", tokens, k=3) == [11, 2, 3]


def test_ngram_returns_the_most_recent_match() -> None:
    assert NgramProposer(1, 2).propose("r", arr([1, 2, 5, 1, 2, 6, 1, 2]), k=2) == [6, 1]


def test_ngram_cuts_at_k_and_at_the_end_of_the_context() -> None:
    proposer = NgramProposer(1, 3)
    assert proposer.propose("r", arr([1, 2, 3, 4, 5, 9, 1, 2, 3]), k=1) == [4]
    # The only earlier "1 2" is followed by just two known tokens.
    assert proposer.propose("r", arr([1, 2, 1, 2]), k=5) == [1, 2]
    assert proposer.propose("r", arr([1, 2, 1, 2]), k=0) == []


def test_ngram_without_a_match_proposes_nothing() -> None:
    proposer = NgramProposer(1, 4)
    assert proposer.propose("r", arr([1, 2, 3, 4]), k=3) == []
    assert proposer.propose("r", arr([7]), k=3) == []
    assert proposer.propose("r", arr([]), k=3) == []


def test_ngram_respects_min_n_and_max_n() -> None:
    tokens = arr([1, 2, 3, 9, 3])  # only the 1-gram "3" recurs
    assert NgramProposer(1, 4).propose("r", tokens, k=2) == [9, 3]
    assert NgramProposer(2, 4).propose("r", tokens, k=2) == []
    tokens = arr([1, 2, 3, 10, 8, 2, 3, 11, 1, 2, 3])
    assert NgramProposer(1, 2).propose("r", tokens, k=1) == [11]  # "2 3", most recent
    assert NgramProposer(1, 3).propose("r", tokens, k=1) == [10]  # "1 2 3"


def test_ngram_searches_only_the_last_max_window_tokens() -> None:
    tokens = arr([4, 5, 6] + [0] * 10 + [9, 4])
    assert NgramProposer(1, 2, max_window=100).propose("r", tokens, k=2) == [5, 6]
    assert NgramProposer(1, 2, max_window=8).propose("r", tokens, k=2) == []


def test_ngram_from_config_and_validation() -> None:
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_min": 2, "prompt_lookup_max": 5,
                                       "max_window": 64})
    assert cfg is not None
    proposer = NgramProposer.from_config(cfg)
    assert (proposer.min_n, proposer.max_n, proposer.max_window) == (2, 5, 64)
    with pytest.raises(ValueError, match="max_window must be >= max_n"):
        NgramProposer(1, 4, max_window=4)
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(3, 2)


# ---- ngram: property against the reference -------------------------------------------


@given(tokens=st.lists(st.integers(0, 3), max_size=60),
       min_n=st.integers(1, 4), extra_n=st.integers(0, 2), k=st.integers(1, 6),
       max_window=st.integers(8, 70))
def test_ngram_matches_the_brute_force_reference(tokens: list[int], min_n: int, extra_n: int,
                                                 k: int, max_window: int) -> None:
    max_n = min_n + extra_n
    proposer = NgramProposer(min_n, max_n, max_window)
    for end in range(len(tokens) + 1):  # every prefix is a context: hundreds of cases
        got = proposer.propose("r", arr(tokens[:end]), k)
        assert got == reference_ngram(tokens[:end], min_n, max_n, k, max_window)
        assert len(got) <= k


# ---- suffix: brute-force reference for the request's own tree -----------------------


def reference_own_walk(tokens: list[int], path: list[int], limit: int, depth: int,
                       min_prob: float) -> tuple[float, list[int]]:
    """Greedy walk from `path` by counting continuations in `tokens` directly."""
    prob, score = 1.0, 0.0
    drafts: list[int] = []
    path = list(path)
    while len(drafts) < limit and len(path) < depth:
        counts: dict[int, int] = {}
        last_seen: dict[int, int] = {}
        for j in range(len(path), len(tokens)):  # j: the token following an occurrence
            if tokens[j - len(path):j] == path:
                counts[tokens[j]] = counts.get(tokens[j], 0) + 1
                last_seen[tokens[j]] = j
        if not counts:
            break
        # Most frequent; on a tie the one that reached that count first.
        best = max(counts, key=lambda t: (counts[t], -last_seen[t]))
        prob *= counts[best] / sum(counts.values())
        if prob < min_prob:
            break
        drafts.append(best)
        score += prob
        path.append(best)
    return score, drafts


def reference_own_proposal(tokens: list[int], k: int, opts: SuffixOptions) -> list[int]:
    best_score, best = 0.0, []
    for m in range(min(len(tokens), opts.max_tree_depth - 1), 0, -1):
        limit = min(k, int(m * opts.max_spec_factor + 1e-6))
        score, drafts = reference_own_walk(tokens, tokens[len(tokens) - m:], limit,
                                           opts.max_tree_depth, opts.min_token_prob)
        if score > best_score:
            best_score, best = score, drafts
    return best


def dump(node: SuffixNode) -> dict[int, Any]:
    """A tree's counts as nested dicts, for structural comparison (the most frequent
    child by its count: which of several tied children is `best` may differ)."""
    return {token: (child.count, child.total, child.best.count if child.best else 0,
                    dump(child))
            for token, child in sorted((c.token, c) for c in node.child_nodes())}


# ---- suffix: hand-made cases ----------------------------------------------------------


def test_suffix_proposes_a_repeated_pattern_from_the_requests_own_tokens() -> None:
    proposer = SuffixProposer()
    proposer.add_request("r", arr([5, 6, 7, 8, 9, 1, 5, 6, 7]))
    assert proposer.propose("r", arr([5, 6, 7, 8, 9, 1, 5, 6, 7]), k=3) == [8, 9, 1]
    # A short match drafts at most m * max_spec_factor tokens: "7" alone -> one draft.
    proposer.add_request("s", arr([3, 7, 8, 9, 4, 7]))
    assert proposer.propose("s", arr([3, 7, 8, 9, 4, 7]), k=3) == [8]


def test_suffix_threshold_stops_low_probability_walks() -> None:
    # After "1 2 3" came 9, 8 and 7 once each: share 1/3 per continuation.
    tokens = arr([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3, 7, 1, 2])
    strict = SuffixProposer(SuffixOptions(min_token_prob=0.5))
    assert strict.propose("r", tokens, k=4) == [3]
    lenient = SuffixProposer(SuffixOptions(min_token_prob=0.3))
    assert lenient.propose("r", tokens, k=4) == [3, 9]  # 9 was first to count 1


def test_suffix_finished_response_seeds_a_new_request_with_the_same_prompt() -> None:
    proposer = SuffixProposer()
    prompt = list(range(10, 18))
    response = [20, 21, 22, 23, 24, 25]
    proposer.add_request("a", arr(prompt))
    for end in range(1, len(response) + 1):  # one token per step, as decoding does
        proposer.propose("a", arr(prompt + response[:end]), k=4)
    proposer.remove_request("a", finished=True)
    assert proposer.cached_response_ids == ["a"]

    proposer.add_request("b", arr(prompt))
    assert proposer.propose("b", arr(prompt), k=4) == [20, 21, 22, 23]
    assert proposer.propose("b", arr([*prompt, 20, 21]), k=4) == [22, 23, 24, 25]
    # Without the global tree the new request has nothing to go on.
    alone = SuffixProposer(SuffixOptions(max_cached_requests=0))
    assert alone.propose("b", arr(prompt), k=4) == []


def test_suffix_prefers_the_own_tree_on_equal_scores() -> None:
    proposer = SuffixProposer()
    proposer.add_request("a", arr([1, 2, 3, 4]))
    proposer.propose("a", arr([1, 2, 3, 4, 5, 6]), k=2)
    proposer.remove_request("a", finished=True)  # global: "... 4 5 6"
    tokens = arr([4, 8, 9, 4])                   # own: "4 8"
    assert proposer.propose("b", tokens, k=1) == [8]


def test_suffix_preemption_does_not_feed_the_global_tree() -> None:
    proposer = SuffixProposer()
    proposer.add_request("a", arr([1, 2, 3]))
    proposer.propose("a", arr([1, 2, 3, 4, 5, 6]), k=2)
    proposer.remove_request("a", finished=False)
    assert proposer.cached_response_ids == []
    assert proposer.global_tree.root.child_nodes() == []
    assert proposer.propose("b", arr([1, 2, 3]), k=3) == []


def test_suffix_global_tree_keeps_the_newest_responses_up_to_the_cap() -> None:
    opts = SuffixOptions(max_tree_depth=6, max_cached_requests=2)
    proposer = SuffixProposer(opts)
    responses = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 10, 11, 12]}
    for rid, response in responses.items():
        proposer.add_request(rid, arr([0]))
        proposer.propose(rid, arr([0, *response]), k=1)
        proposer.remove_request(rid, finished=True)
    assert proposer.cached_response_ids == ["b", "c"]
    assert proposer.propose("x", arr([1, 2]), k=2) == []         # "a" was evicted
    assert proposer.propose("y", arr([5, 6]), k=2) == [7, 8]
    expected = SuffixTree(6)
    expected.insert([0, 5, 6, 7, 8])
    expected.insert([0, 9, 10, 11, 12])
    assert dump(proposer.global_tree.root) == dump(expected.root)


def test_suffix_unknown_request_is_added_on_the_spot() -> None:
    tokens = arr([5, 6, 7, 8, 5, 6])
    implicit = SuffixProposer()
    explicit = SuffixProposer()
    explicit.add_request("r", tokens)
    assert implicit.propose("r", tokens, k=3) == explicit.propose("r", tokens, k=3) == [7, 8]
    implicit.remove_request("never-added", finished=True)  # a no-op, not an error


def test_suffix_refuses_tokens_that_shrink() -> None:
    proposer = SuffixProposer()
    proposer.add_request("r", arr([1, 2, 3]))
    with pytest.raises(ValueError, match=r"got 2 tokens but already indexed 3"):
        proposer.propose("r", arr([1, 2]), k=2)


def test_suffix_from_config_reads_options() -> None:
    cfg = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 4,
                                       "max_tree_depth": 8, "min_token_prob": 0.2,
                                       "max_cached_requests": 3})
    assert cfg is not None
    opts = SuffixProposer.from_config(cfg).options
    assert (opts.max_tree_depth, opts.min_token_prob, opts.max_cached_requests) == (8, 0.2, 3)
    assert opts.max_spec_factor == 1.0
    with pytest.raises(ValueError, match="min_token_prob must be in"):
        SuffixOptions(min_token_prob=1.5)
    with pytest.raises(ValueError, match="max_tree_depth must be >= 2"):
        SuffixOptions(max_tree_depth=1)


# ---- suffix: properties -------------------------------------------------------------


suffix_options = st.builds(
    SuffixOptions, max_tree_depth=st.integers(2, 8),
    min_token_prob=st.sampled_from([0.0, 0.1, 0.3, 0.6]),
    max_spec_factor=st.sampled_from([0.5, 1.0, 2.0]))


@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=50), data=st.data(),
       opts=suffix_options, k=st.integers(1, 6))
def test_suffix_incremental_updates_equal_a_rebuild_and_the_reference(
        tokens: list[int], data: st.DataObject, opts: SuffixOptions, k: int) -> None:
    prompt_len = data.draw(st.integers(1, len(tokens)))
    incremental = SuffixProposer(opts)
    incremental.add_request("r", arr(tokens[:prompt_len]))
    end = prompt_len
    while True:
        got = incremental.propose("r", arr(tokens[:end]), k)
        rebuilt = SuffixProposer(opts)
        rebuilt.add_request("r", arr(tokens[:end]))
        assert got == rebuilt.propose("r", arr(tokens[:end]), k)
        assert dump(incremental._requests["r"].tree.root) == dump(rebuilt._requests["r"].tree.root)
        assert got == reference_own_proposal(tokens[:end], k, opts)
        assert len(got) <= k
        if end == len(tokens):
            break
        end = min(len(tokens), end + data.draw(st.integers(1, 4)))  # 1 + accepted drafts


@given(responses=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12),
                          min_size=1, max_size=8),
       cap=st.integers(1, 3), depth=st.integers(2, 6))
def test_suffix_global_tree_equals_one_built_from_the_kept_responses(
        responses: list[list[int]], cap: int, depth: int) -> None:
    proposer = SuffixProposer(SuffixOptions(max_tree_depth=depth, max_cached_requests=cap))
    prompt = [7, 8, 9]
    kept: dict[str, list[int]] = {}  # the model: insertion order = age, oldest first
    for i, response in enumerate(responses):
        rid = f"r{i % 4}"  # ids get reused: a newer response replaces the older one
        proposer.add_request(rid, arr(prompt))
        assert len(proposer.propose(rid, arr(prompt + response), k=3)) <= 3
        proposer.remove_request(rid, finished=True)
        kept.pop(rid, None)
        kept[rid] = prompt[-(depth - 1):] + response
        while len(kept) > cap:
            del kept[next(iter(kept))]
        expected = SuffixTree(depth)
        for seq in kept.values():
            expected.insert(seq)
        assert proposer.cached_response_ids == list(kept)
        assert dump(proposer.global_tree.root) == dump(expected.root)


@given(tokens=st.lists(st.integers(0, 3), min_size=2, max_size=40), data=st.data(),
       k=st.integers(1, 4))
def test_suffix_builds_a_requests_tree_at_its_first_draft_as_if_it_had_followed(
        tokens: list[int], data: st.DataObject, k: int) -> None:
    """`add_request` only keeps the start tokens: a request parked for a while (no
    `propose`) gets at its first draft the tree, the drafts and, once finished, the
    global tree's response of one that was proposed for at every step."""
    prompt_len = data.draw(st.integers(1, len(tokens) - 1))
    followed, parked = SuffixProposer(), SuffixProposer()
    followed.add_request("r", arr(tokens[:prompt_len]))
    parked.add_request("r", arr(tokens[:prompt_len]))
    assert "r" not in parked._requests  # no tree until it drafts
    for end in range(prompt_len, len(tokens) + 1):
        followed.propose("r", arr(tokens[:end]), k)
    assert parked.propose("r", arr(tokens), k) == followed.propose("r", arr(tokens), k)
    assert dump(parked._requests["r"].tree.root) == dump(followed._requests["r"].tree.root)
    followed.remove_request("r", finished=True)
    parked.remove_request("r", finished=True)
    assert parked._responses == followed._responses


def test_suffix_builds_no_tree_for_a_request_that_never_drafts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import spec_decode.suffix as suffix

    built = []

    class Counting(SuffixTree):
        def __init__(self, depth: int) -> None:
            built.append(depth)
            super().__init__(depth)

    monkeypatch.setattr(suffix, "SuffixTree", Counting)
    proposer = suffix.SuffixProposer()
    built.clear()
    for i in range(5):
        proposer.add_request(f"r{i}", arr(list(range(40))))
        proposer.remove_request(f"r{i}", finished=True)
    assert built == [] and proposer.cached_response_ids == []
    proposer.add_request("d", arr(list(range(40))))
    proposer.propose("d", arr(list(range(44))), 2)
    assert len(built) == 1
