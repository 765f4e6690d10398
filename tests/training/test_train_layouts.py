"""Training lays a head's rows out exactly as serving does.

The proof: serve a prompt with a head (eagle, parallel, dflash), record the hidden
state behind every draft the runner proposed and where, then run the training forward
(training/train.py: unroll) over the finished sequence and find the same hidden
states on the rows that layout says. A layout mismatch between the two (a token
shift, a mask row's inputs, the anchor of a chain) makes them disagree, as the
crossed-layout case shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engine.llm import LLM
from runner import drafter
from runner.drafter import ModelDrafter
from runner.eagle3 import Eagle3Config, Eagle3Head, save_eagle3
from scheduler import SamplingParams
from spec_decode.methods import TrainLayout, get_method
from tests.server_helpers import default_model
from training.features import target_features
from training.layouts import greedy_run, live_rows, step_targets, train_layout
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


def _serve_and_record(method: str, prompt: str, monkeypatch: pytest.MonkeyPatch,
                      model: str = "random") -> tuple[Any, list[int], list[Proposal]]:
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
    # The head on the target's own float32 kernel: where "auto" serves float32, a
    # head's calls otherwise hold its weights in bfloat16, or beside a target on GGUF
    # blocks round them to Q8_0 blocks (runner/models/linear_draft.py), either of which
    # moves its hidden states past this check's tolerance. The rows are what is
    # checked here; those kernels have their own tests.
    monkeypatch.setattr(drafter, "draft_kernel", lambda target, dtype: target)
    llm = LLM(loaded_model=default_model(), num_kv_blocks=32, max_model_len=256,
              speculative_config={"method": method, "num_speculative_tokens": K,
                                  "model": model, "draft_policy": "fixed",
                                  # a loaded chain head's gate would stop chains early
                                  **({"min_draft_confidence": 0.0}
                                     if get_method(method).sequential else {})})
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


@pytest.mark.parametrize("method", ["eagle", "dflash"])
def test_a_deeper_heads_training_rows_reproduce_served_drafts(
        method: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A head of two decoder layers (`train-drafter --head-layers 2`), written and
    loaded as a checkpoint: every served draft's hidden state is on its training row,
    and a training forward that skips the second layer finds none of them."""
    target = default_model()
    save_eagle3(Eagle3Head(Eagle3Config.for_target(target.config, 512, 2), target, seed=0),
                tmp_path / "head")
    head, seq, log = _serve_and_record(method, "def fibonacci(n):", monkeypatch,
                                       str(tmp_path / "head"))
    assert head.num_layers == 2
    layout = train_layout(method)
    equal, compared = _compare(seq, log, _training_outputs(head, seq, layout), layout)
    assert compared >= 10 and equal == compared, (equal, compared)
    extra, head.extra_layers = head.extra_layers, nn.ModuleList()  # (packed: no deepcopy)
    try:
        shallow = _training_outputs(head, seq, layout)
    finally:
        head.extra_layers = extra
    equal, compared = _compare(seq, log, shallow, layout)
    assert compared >= 10 and equal == 0, (equal, compared)


def test_live_rows_by_hand() -> None:
    """Two steps over five rows: step 1's row 3 is scored (its chain is anchored at 2),
    step 0 scores row 1. Step 1 runs row 3 only; the context runs rows 0-3 (row 3 is
    the anchor's + 1, which the chain reads as a key, and the rows before it stay live
    for the causal attention). A window shorter than the steps runs no later row."""
    scored = [torch.tensor([[False, True, False, False, False]]),
              torch.tensor([[False, False, False, True, False]])]
    context, later = live_rows(scored)
    assert context.tolist() == [[True, True, True, True, False]]
    assert later.tolist() == [[False, False, False, True, False]]
    none = torch.zeros(1, 2, dtype=torch.bool)
    short = live_rows([torch.ones(1, 2, dtype=torch.bool), *[none] * 4])
    assert [s.tolist() for s in short] == [[[True, True]]] + [[[False, False]]] * 4


@pytest.mark.parametrize("method", ["eagle", "parallel", "dflash"])
def test_only_live_rows_run_and_every_scored_row_is_unchanged(method: str) -> None:
    """Training runs a step's rows only where a scored row reads them
    (`layouts.live_rows`): a window's prompt text and the padding past its answer
    carry no label, so later steps skip their chains. Every scored row comes out as
    with all rows run; dropping the prompt's context rows, which no chain is scored on
    but every chain reads as keys, changes them (the check bites)."""
    model = default_model()
    head = Eagle3Head(Eagle3Config.for_target(model.config, 512), model, seed=0)
    layout = train_layout(method)
    tokens = torch.tensor([[(7 * i + 3 * n) % 400 + 10 for i in range(40)] for n in range(2)])
    aux, labels, _ = target_features(model, tokens, head.head_config.aux_layer_ids,
                                     dtype=torch.float32)
    labels = labels.clone()
    labels[:, :12] = IGNORE  # the prompt: context only
    labels[1, 30:] = IGNORE  # the second answer ended early: padding
    chain = torch.full_like(tokens, 40)  # as if each token were the target's greedy one
    rows = tokens.shape[1] - layout.token_shift
    scored = [step_targets(layout, labels, chain, rows, j, IGNORE) != IGNORE
              if j >= layout.first_loss_step else torch.zeros(2, rows, dtype=torch.bool)
              for j in range(len(layout.steps(K)))]
    live = live_rows(scored)
    assert all(float(step.float().mean()) < 0.8 for step in live[1:])  # a real saving
    with torch.no_grad():
        full = unroll(head, aux, tokens, K, layout)
        part = unroll(head, aux, tokens, K, layout, live)
        broken = [live[0].clone(), *live[1:]]
        broken[0][:, :12] = False
        wrong = unroll(head, aux, tokens, K, layout, broken)
    assert all(int(s.sum()) > 20 for s in scored[layout.first_loss_step:])
    for a, b, s in zip(full, part, scored, strict=True):
        assert torch.allclose(a[s], b[s], atol=1e-5)
    assert not all(torch.allclose(a[s], w[s], atol=1e-3)
                   for a, w, s in zip(full, wrong, scored, strict=True) if s.any())
