"""Training lays a head's rows out exactly as serving does.

The proof: serve a prompt with a head (eagle, parallel, dflash), record the hidden
state behind every draft the runner proposed and where, then run the training forward
(training/train.py: unroll) over the finished sequence and find the same hidden
states on the rows that layout says. A layout mismatch between the two (a token
shift, a mask row's inputs, the anchor of a chain) makes them disagree, as the
crossed-layout case shows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.llm import LLM
from runner.drafter import ModelDrafter
from scheduler import SamplingParams
from spec_decode.methods import TrainLayout
from tests.server_helpers import default_model
from training.features import target_features
from training.layouts import greedy_run, step_targets, train_layout
from training.train import IGNORE, unroll

pytestmark = pytest.mark.model  # loads the real default model

K = 3


def test_greedy_run_counts_consecutive_greedy_tokens() -> None:
    tokens = torch.tensor([[5, 1, 2, 9, 4, 6]])
    labels = torch.tensor([[1, 2, 3, 4, 6, IGNORE]])  # greedy after each position
    # p: next token is greedy? 0 yes(1), 1 yes(2), 2 no(9 != 3), 3 yes, 4 yes, 5 -
    assert greedy_run(tokens, labels).tolist() == [[1, 2, 0, 1, 2, 0]]


def test_step_targets_follow_each_layout() -> None:
    labels = torch.arange(10, 16)[None, :]  # labels[t] = 10 + t
    run = torch.tensor([[1, 2, 3, 0, 1, 2]])  # the chain breaks at position 3
    # parallel step 1 (the first mask row): row r predicts labels[r + 1]; its anchor
    # r - 1 must exist and the drafted position r must have been greedy.
    got = step_targets(train_layout("parallel"), labels, run, 5, 1, IGNORE)
    assert got.tolist() == [[IGNORE, 12, 13, IGNORE, 15]]
    # dflash step 3 (the second mask row): row r predicts labels[r - 1], anchored at r - 3,
    # with the one mask position before it (r - 2) greedy.
    got = step_targets(train_layout("dflash"), labels, run, 6, 3, IGNORE)
    assert got.tolist() == [[IGNORE, IGNORE, IGNORE, 12, 13, IGNORE]]


Proposal = tuple[int, list[int], list[torch.Tensor]]  # bonus position, drafts, hiddens


def _serve_and_record(method: str, prompt: str, monkeypatch: pytest.MonkeyPatch
                      ) -> tuple[Any, list[int], list[Proposal]]:
    """The head, the finished sequence, and every proposal (one request: the hidden
    states reach `greedy_tokens` in draft order)."""
    log: list[Proposal] = []
    hiddens: list[torch.Tensor] = []
    propose = ModelDrafter.propose

    def recording(self: ModelDrafter, res: Any, features: Any, req_ids: list[str],
                  planned: Any) -> dict[str, list[int]]:
        greedy = self.net.greedy_tokens

        def record(hidden: torch.Tensor) -> torch.Tensor:
            hiddens.extend(hidden.detach().clone())
            return greedy(hidden)

        self.net.greedy_tokens = record  # type: ignore[method-assign]
        try:
            drafts = propose(self, res, features, req_ids, planned)
        finally:
            del self.net.greedy_tokens
        for rid, draft in drafts.items():
            i = req_ids.index(rid)
            log.append((int(res.computed[i] + res.valid[i]), list(draft), hiddens[:]))
        hiddens.clear()
        return drafts

    monkeypatch.setattr(ModelDrafter, "propose", recording)
    llm = LLM(loaded_model=default_model(), num_kv_blocks=32, max_model_len=256,
              speculative_config={"method": method, "num_speculative_tokens": K,
                                  "model": "random", "draft_policy": "fixed"})
    head = llm.engine.runner.spec.drafter.net  # type: ignore[union-attr]
    with torch.no_grad():  # mask rows that differ from a zero start
        head.mask_hidden.copy_(torch.randn(head.mask_hidden.shape,
                                           generator=torch.Generator().manual_seed(1)))
    out = llm.generate([prompt], SamplingParams(max_tokens=24))[0]
    return head, out.prompt_token_ids + list(out.outputs[0].token_ids), log


def _training_outputs(head: Any, seq: list[int], layout: TrainLayout) -> list[torch.Tensor]:
    """Every unrolled step's output rows [rows, H] over the finished sequence."""
    tokens = torch.tensor([seq])
    aux, _, _ = target_features(default_model(), tokens, head.head_config.aux_layer_ids,
                             dtype=torch.float32)
    with torch.no_grad():
        return [out[0] for out in unroll(head, aux, tokens, K, layout)]


def _compare(seq: list[int], log: list[Proposal], outs: list[torch.Tensor],
             layout: TrainLayout) -> tuple[int, int]:
    """(equal, compared) hidden states: each draft m of the anchor at bonus position b
    against the training row that serves it (eagle's later drafts only while the chain
    held, since training feeds the real tokens where serving feeds its drafts)."""
    equal = compared = 0
    for b, drafts, hiddens in log:
        for m, (draft, hidden) in enumerate(zip(drafts, hiddens, strict=True), start=1):
            step, row = (m + 1, b + m) if layout.bonus else (m - 1, b + m - 2)
            if row >= len(outs[step]):
                break
            compared += 1
            equal += bool(torch.allclose(outs[step][row], hidden, atol=1e-3, rtol=1e-3))
            if layout.later == "feedback" and (b + m >= len(seq) or seq[b + m] != draft):
                break
    return equal, compared


@pytest.mark.parametrize("method", ["eagle", "parallel", "dflash"])
def test_training_rows_reproduce_served_drafts(method: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    head, seq, log = _serve_and_record(method, "def fibonacci(n):", monkeypatch)
    layout = train_layout(method)
    equal, compared = _compare(seq, log, _training_outputs(head, seq, layout), layout)
    assert compared >= 10 and equal == compared, (equal, compared)
    # The check bites: read with another method's layout, the same rows disagree.
    crossed = train_layout("dflash" if method != "dflash" else "parallel")
    equal, compared = _compare(seq, log, _training_outputs(head, seq, crossed), crossed)
    assert compared >= 10 and equal == 0, (equal, compared)
