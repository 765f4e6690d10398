"""Drafter training data: features kept while the target generates, the windows cut
from them, the training instructions, and the soft-target loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.llm import LLM
from runner.eagle3 import default_aux_layers
from runner.feature_capture import CapturedFeatures, FeatureCapture
from scheduler import SamplingParams
from tests.server_helpers import default_model
from training.features import greedy_labels, target_features
from training.generate import IGNORE, answer_window, generate_windows
from training.pipeline import DATA_MAX_MODEL_LEN, WINDOW, data_llm
from training.prompts import (
    TEMPLATES,
    TOPICS,
    first_turns,
    follow_up,
    held_out_turns,
    instructions,
)
from training.train import soft_loss, with_noise

PROMPTS = ["Write a haiku about rivers.", "List three facts about tea."]


def captured(llm: LLM, aux_ids: tuple[int, ...]) -> list[tuple[list[int], CapturedFeatures]]:
    capture = FeatureCapture(aux_ids, dtype=torch.float32)
    llm.engine.runner.attach_capture(capture)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                    SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    llm.engine.runner.attach_capture(None)
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
             capture.take(o.request_id)) for o in outs]


@pytest.mark.model
def test_features_kept_while_generating_equal_a_teacher_forced_pass() -> None:
    """Prompts chunked over several steps (a budget of 16 rows), then decoded together:
    every position's layer inputs and final hidden state equal those of one
    teacher-forced pass over the finished text, and each generated token is the
    teacher-forced argmax (greedy). Read one position off, they would not be."""
    model = default_model()
    aux_ids = default_aux_layers(model.config.num_hidden_layers)
    llm = LLM(loaded_model=model, max_num_batched_tokens=16, max_num_seqs=2,
              max_model_len=256, enable_prefix_caching=False)
    for full, got in captured(llm, aux_ids):
        assert len(got.aux) == len(full) - 1  # the last token: never read yet
        aux, labels, final = target_features(model, torch.tensor([full]), aux_ids,
                                             dtype=torch.float32)
        torch.testing.assert_close(got.aux, aux[0, :-1], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(got.final, final[0, :-1], atol=2e-3, rtol=2e-3)
        prompt_end = len(full) - 21
        assert labels[0, prompt_end:-1].tolist() == full[prompt_end + 1:]
        assert not torch.allclose(got.aux[1:], aux[0, :-2], atol=2e-3, rtol=2e-3)


@pytest.mark.model
def test_greedy_labels_in_row_chunks_equal_one_argmax_over_every_row() -> None:
    """The labels made a few rows at a time (the last chunk short) are the argmax of
    the logits of every row at once; a chunk's rows read in the wrong order are not."""
    model = default_model()
    hidden = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = model.compute_logits(hidden).argmax(dim=-1)
    assert torch.equal(greedy_labels(model, hidden, rows=8), whole)
    assert not torch.equal(greedy_labels(model, hidden.flip(0), rows=8), whole)


@pytest.mark.model
def test_generated_windows_label_the_answer_only() -> None:
    model = default_model()
    aux_ids = default_aux_layers(model.config.num_hidden_layers)
    llm = LLM(loaded_model=model, max_num_seqs=2, max_model_len=256,
              enable_prefix_caching=False)
    windows, answers = generate_windows(
        llm, [[{"role": "user", "content": p}] for p in PROMPTS], 32, aux_ids)
    assert windows.tokens.shape == (2, 32) and windows.aux.shape[:2] == (2, 32)
    assert all(0 < len(a) <= 24 for a in answers)  # at most 3/4 of the window
    for i, answer in enumerate(answers):
        labelled = windows.labels[i] != IGNORE
        # A quarter window of prompt, then the answer: the last prompt position labels
        # the first answer token, the last token but one the last.
        assert windows.labels[i][labelled].tolist() == answer
        assert int(labelled.nonzero()[0]) == 32 // 4 - 1


@pytest.mark.model
def test_the_data_engine_preempts_no_request_at_its_longest_context() -> None:
    """`data_llm` holds every request of its batch at the longest context it allows:
    four conversations that nearly fill it decode their whole answers with no
    preemption (a preempted request would run its positions again). The same four in
    a pool that holds their prompts and two blocks more are preempted, so the count
    can fail."""
    model = default_model()
    aux_ids = default_aux_layers(model.config.num_hidden_layers)
    long_turns = [[{"role": "user", "content": f"{p} " + "Note it. " * 120}] for p in
                  PROMPTS * 2]

    def preemptions(llm: LLM) -> int:
        generate_windows(llm, long_turns, WINDOW, aux_ids)
        return llm.get_metrics()["num_preemptions"]

    llm = data_llm(model, 4)
    assert llm.config.max_model_len == DATA_MAX_MODEL_LEN
    assert preemptions(llm) == 0
    block = llm.config.block_size
    tok = llm.tokenizer
    prompts = [-(-len(tok.encode(tok.apply_chat_template(turn))) // block) for turn in long_turns]
    assert sum(prompts) > 4 * DATA_MAX_MODEL_LEN // block // 2  # the pool at least half full
    assert preemptions(data_llm(model, 4, num_kv_blocks=sum(prompts) + 2)) > 0


@pytest.mark.model
def test_capture_is_refused_with_speculation_or_prefix_caching_on() -> None:
    llm = LLM(loaded_model=default_model(), num_kv_blocks=16, max_model_len=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2},
              enable_prefix_caching=False)
    with pytest.raises(ValueError, match="speculation off"):
        llm.engine.runner.attach_capture(FeatureCapture((2,)))
    cached = LLM(loaded_model=default_model(), num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        generate_windows(cached, [[{"role": "user", "content": "Hi"}]], 32, (2,))


def test_an_answer_window_keeps_a_quarter_window_of_prompt() -> None:
    """Prompt of 12, answer of 30, window 16: it starts 4 before the answer; labels run
    from the last prompt position; features come from the captured positions."""
    full = list(range(100, 142))
    got = CapturedFeatures(torch.arange(41.0)[:, None].repeat(1, 3),
                           torch.arange(41.0)[:, None])
    w = answer_window(full, 12, got, 16, pad=0)
    assert w.tokens[0].tolist() == full[8:24]
    assert w.labels[0].tolist() == [IGNORE] * 3 + full[12:25]
    assert w.aux[0, :, 0].tolist() == list(range(8, 24))
    short = answer_window(full[:15], 12, got, 16, pad=0)  # answer of 3, padded
    assert short.labels[0].tolist() == [IGNORE] * 3 + full[12:15] + [IGNORE] * 10
    assert short.tokens[0, 7:].tolist() == [0] * 9


def test_a_captured_step_is_kept_until_every_request_in_it_is_taken() -> None:
    """A step's rows are one tensor shared by its requests: each request gets its own
    rows back, and the step is let go once none of them is still held (taken or
    discarded), not before."""
    capture = FeatureCapture((1,), dtype=torch.float32)
    rows = torch.arange(12.0).reshape(6, 2)
    capture.record(["a", "b", "c"], np.array([0, 0, 0]), np.array([2, 1, 1]), rows[:5],
                   rows[:5] * 10)  # a fifth row: another request's padding, never kept
    capture.record(["a"], np.array([2]), np.array([1]), rows[5:], rows[5:] * 10)
    assert capture.held_steps() == 2
    a = capture.take("a")
    assert a.aux.tolist() == [[0, 1], [2, 3], [10, 11]]
    assert torch.equal(a.final, a.aux * 10)
    assert capture.held_steps() == 1  # a's second step is gone; b and c hold the first
    assert capture.take("b").aux.tolist() == [[4, 5]]
    assert capture.held_steps() == 1
    capture.discard("c")
    assert capture.held_steps() == 0
    with pytest.raises(KeyError):
        capture.take("c")


def test_a_capture_with_a_gap_is_refused() -> None:
    capture = FeatureCapture((1,))
    rows = torch.zeros(3, 4)
    capture.record(["a"], torch.tensor([0]).numpy(), torch.tensor([2]).numpy(), rows[:2],
                   rows[:2])
    capture.record(["a"], torch.tensor([3]).numpy(), torch.tensor([1]).numpy(), rows[:1],
                   rows[:1])
    with pytest.raises(ValueError, match=r"positions \[2\] were never run"):
        capture.take("a")


def test_training_instructions_are_many_distinct_and_never_held_out() -> None:
    train = first_turns("train", 0)
    assert len(set(train)) == len(train) >= 3000  # against 540 before
    assert not set(train) & set(instructions("eval"))
    # The held-out turns (evaluation's windows) share no instruction with training,
    # code tasks included (they name no topic, so both splits list them), and hold
    # the benchmarks' held-out set.
    held_out = held_out_turns(0)
    assert len(held_out) >= 400 and not set(train) & set(held_out)
    assert set(first_turns("eval", 0)) & set(train)  # what held_out_turns leaves out
    assert set(instructions("eval")) <= set(held_out)
    # Served figures and benchmarks take a prefix of the held-out instructions: the
    # first 12 are every template once, over every held-out topic evenly.
    first = instructions("eval")[:12]
    topics = [t for t in TOPICS if any(t in p for p in instructions("eval"))]
    assert len(topics) == 3 and len(set(instructions("eval"))) == 36
    assert [sum(t in p for p in first) for t in topics] == [4, 4, 4]
    assert [t.format(t="X") for t in TEMPLATES] == [
        p.replace(t, "X") for p in first for t in topics if t in p]
    assert train == first_turns("train", 0) and train != first_turns("train", 1)
    assert len(first_turns("train", 1)) == len(train)  # the seed orders and numbers
    kinds = ("dialogue", "Rust", "step by step", "Summarise this text")
    assert all(any(kind in p for p in train) for kind in kinds)
    turn = follow_up("Q?", "A.", 0)
    assert [m["role"] for m in turn] == ["user", "assistant", "user"]


def test_soft_targets_match_the_target_distribution() -> None:
    """The KL is zero where the head's distribution over the draft vocabulary is the
    target's, positive elsewhere, and its gradient moves the head toward it: toward
    the whole distribution, not only its argmax."""
    gen = torch.Generator().manual_seed(0)
    teacher, final = torch.randn(32, 8, generator=gen), torch.randn(5, 8, generator=gen)
    exact = final @ teacher.T
    assert float(soft_loss(exact, final, teacher)) == pytest.approx(0.0, abs=1e-5)
    logits = torch.zeros(5, 32, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=20.0)
    first = float(soft_loss(logits, final, teacher).detach())
    for _ in range(200):
        opt.zero_grad()
        soft_loss(logits, final, teacher).backward()
        opt.step()
    assert first > 0.1 and float(soft_loss(logits, final, teacher).detach()) < 0.01 * first
    # The runner-up tokens are ranked as the target ranks them.
    assert torch.equal(logits.detach().argsort(-1)[:, -3:], exact.argsort(-1)[:, -3:])


def test_feature_noise_scales_with_each_row() -> None:
    gen = torch.Generator().manual_seed(0)
    aux = torch.randn(2000, 64, generator=gen) * torch.tensor([1.0, 100.0]).repeat(1000)[:, None]
    assert torch.equal(with_noise(aux, 0.0), aux)
    noise = with_noise(aux, 0.05, torch.Generator().manual_seed(0)) - aux
    rel = noise.pow(2).mean(-1).sqrt() / aux.pow(2).mean(-1).sqrt()
    assert rel.mean().item() == pytest.approx(0.05, rel=0.1)
