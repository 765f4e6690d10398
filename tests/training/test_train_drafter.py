"""A tiny drafter training (seconds) on the real default model proves the pipeline
learns: features from the target's own paged forward, labels its own greedy tokens,
an EAGLE-3 head trained with training-time test in each method's layout. Held-out loss
falls, and the trained head agrees with the target far more often than before, on
held-out code."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.tokenizer import Tokenizer
from runner.eagle3 import Eagle3Config, Eagle3Head
from runner.model_prep import resolve_model
from tests.server_helpers import default_model
from training.data import code_windows, is_eval_source, stdlib_files
from training.features import target_features
from training.layouts import greedy_run
from training.options import head_init
from training.train import (
    IGNORE,
    MISSING,
    Batch,
    TrainConfig,
    adamw,
    draft_vocab,
    evaluate,
    init_from_target,
    train_head,
    unrolled_loss,
)

pytestmark = pytest.mark.model  # loads the real default model

LENGTH, DRAFT_VOCAB = 48, 512


@pytest.fixture(scope="module")
def data() -> tuple[Batch, Batch, torch.Tensor]:
    model = default_model()
    tokenizer = Tokenizer.from_dir(resolve_model(None))
    config = Eagle3Config.for_target(model.config, DRAFT_VOCAB)
    splits = {}
    for split, count in (("train", 64), ("eval", 16)):
        windows = code_windows(tokenizer, LENGTH, count, split)
        aux, labels, final = target_features(model, windows, config.aux_layer_ids)
        splits[split] = (windows, aux, labels, final)
    d2t, t2d = draft_vocab(splits["train"][2], model.config.vocab_size, DRAFT_VOCAB)
    teacher = model.lm_head.weight.detach()[torch.arange(DRAFT_VOCAB) + d2t].float()

    def batch(split: str) -> Batch:
        windows, aux, labels, final = splits[split]
        # Labels outside the draft vocabulary stay MISSING: misses, as when serving.
        return Batch(aux, windows, t2d[labels], greedy_run(windows, labels), final, teacher)

    return batch("train"), batch("eval"), d2t


def fresh_head(d2t: torch.Tensor) -> Eagle3Head:
    model = default_model()
    head = Eagle3Head(Eagle3Config.for_target(model.config, DRAFT_VOCAB), model, seed=0)
    init_from_target(head, model, d2t)
    return head


def test_the_splits_share_no_source_file() -> None:
    names = [p.name for p in stdlib_files()]
    evals = {n for n in names if is_eval_source(n)}
    assert evals and len(evals) < len(names) / 4  # about one file in ten


def hard(batch: Batch) -> Batch:
    """The batch without soft targets: cross-entropy on the greedy token."""
    return replace(batch, final=None, teacher=None)


@pytest.mark.parametrize(("method", "loss"), [
    ("eagle", "kl"), ("parallel", "kl"), ("dflash", "kl"), ("eagle", "ce")])
def test_tiny_training_learns_on_held_out_code(method: str, loss: str,
                                               data: tuple[Batch, Batch, torch.Tensor],
                                               tmp_path: Path) -> None:
    """Each layout learns, on soft targets and on the greedy token alone: held-out loss
    falls and every draft agrees with the target more often than before."""
    train, held_out, d2t = data
    if loss == "ce":
        train, held_out = hard(train), hard(held_out)
    head = fresh_head(d2t)
    before_loss, before_acc = evaluate(head, held_out, 2, method)
    config = TrainConfig(updates=60, batch_size=8, lr=3e-3, depth=2, seed=0,
                         checkpoint_every=30, method=method)
    losses = train_head(head, train, config, checkpoint=tmp_path / "ckpt.pt", progress=False)
    after_loss, after_acc = evaluate(head, held_out, 2, method)
    assert len(losses) == 60 and after_loss < 0.8 * before_loss
    # First-draft agreement with the target's own greedy token.
    assert after_acc[0] > 0.05 and after_acc[0] > 2 * before_acc[0], (before_acc, after_acc)
    assert after_acc[1] > before_acc[1]  # the second draft learned too


def test_bfloat16_autocast_trains_as_float32_does(data: tuple[Batch, Batch, torch.Tensor],
                                                  recwarn: pytest.WarningsRecorder) -> None:
    """What train-drafter does where bfloat16 is native: the same updates under bfloat16
    autocast as in float32 give losses within bfloat16's rounding of float32's and move
    the weights the same way, and autocast really ran (the losses are not float32's
    bits). The float32 runs above show those updates learn. A whole run under autocast
    took 233 s on an AVX2 CPU, where bfloat16 matmuls are emulated; four updates show
    the same. Autocast prints no torch warning at the user (train-drafter printed one
    per run)."""
    train = hard(data[0])
    start = {n: p.detach().clone() for n, p in fresh_head(data[2]).named_parameters()}
    config = TrainConfig(updates=60, batch_size=8, lr=3e-3, depth=2, seed=0, method="eagle")
    runs = {}
    for bf16 in (False, True):
        head = fresh_head(data[2])
        losses = train_head(head, train, replace(config, autocast_bf16=bf16),
                            progress=False, stop_at=4)
        moved = torch.cat([(p.detach() - start[n]).flatten()
                           for n, p in head.named_parameters() if p.requires_grad])
        runs[bf16] = (losses, moved)
    (fp32, fp32_moved), (bf16, bf16_moved) = runs[False], runs[True]
    assert len(bf16) == 4 and bf16 != fp32
    assert all(abs(b - f) < 0.01 * f for f, b in zip(fp32, bf16, strict=True)), (fp32, bf16)
    assert torch.nn.functional.cosine_similarity(fp32_moved, bf16_moved, dim=0) > 0.99
    assert not [w for w in recwarn if "Mismatch dtype" in str(w.message)]


def test_the_draft_vocabulary_is_the_most_frequent_labels_then_the_lowest_ids() -> None:
    labels = torch.tensor([[7, 7, 7, 40, 40, 90], [90, 90, 90, 90, 3, IGNORE]])
    d2t, t2d = draft_vocab(labels[labels >= 0], 100, 3)
    assert (torch.arange(3) + d2t).tolist() == [7, 40, 90]  # by count, in id order
    assert t2d[90] == 2 and t2d[3] == MISSING
    # More rows than distinct labels: the rest are the lowest unlabelled ids (topk's
    # own order among zero counts is arbitrary, e.g. 66, 67, 68 of 100).
    d2t, t2d = draft_vocab(labels[labels >= 0], 100, 8)
    assert (torch.arange(8) + d2t).tolist() == [0, 1, 2, 3, 4, 7, 40, 90]
    assert (t2d >= 0).sum() == 8


def test_a_token_outside_the_draft_vocabulary_is_a_miss_not_skipped(
        data: tuple[Batch, Batch, torch.Tensor]) -> None:
    """Serving can never draft a token the draft vocabulary lacks, so agreement counts
    it as a miss; it carries no loss (it has no draft id)."""
    _, soft, d2t = data
    held_out = hard(soft)
    head = fresh_head(d2t)
    missing = Batch(held_out.aux, held_out.tokens, torch.full_like(held_out.labels, MISSING),
                    held_out.chain)
    loss, accs = unrolled_loss(head, missing, 2)
    assert float(loss.detach()) == 0.0 and accs[0][0] == 0 and accs[0][1] > 0
    scored = unrolled_loss(head, held_out, 2)[1][0][1]
    assert accs[0][1] == scored  # the same rows scored, none of them hits
    # Soft targets: the target's distribution over the draft vocabulary still teaches
    # there (the greedy token is missing, the rest of the mass is not).
    assert float(unrolled_loss(head, replace(soft, labels=missing.labels), 2)[0].detach()) > 0.0


def test_training_is_deterministic_and_resumes(data: tuple[Batch, Batch, torch.Tensor],
                                               tmp_path: Path) -> None:
    """Same seed, same head; a run stopped at a checkpoint and resumed ends where an
    unbroken run ends."""
    train, _, d2t = data
    config = TrainConfig(updates=12, batch_size=4, lr=2e-3, depth=2, seed=3,
                         checkpoint_every=6)
    whole = fresh_head(d2t)
    train_head(whole, train, config, progress=False)
    stopped = fresh_head(d2t)
    train_head(stopped, train, config, checkpoint=tmp_path / "c.pt", progress=False,
               stop_at=6)
    resumed = fresh_head(d2t)
    train_head(resumed, train, config, checkpoint=tmp_path / "c.pt", progress=False)
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items(),
                                 strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_train_drafter_command_writes_a_head_that_serves(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole command at toy size: self-distilled chat answers and code, features,
    training, the head in the EAGLE-3 layout with its metrics; then `"method":
    "eagle"` without a model finds it as the trained default and serves losslessly."""
    import json

    import runner.drafter as drafter
    import training.served as served_module
    from engine.llm import LLM
    from scheduler import SamplingParams
    from specbudget.cli import main

    # The served figure runs in a fresh process of its own: served here, in the
    # process that trained, it read slower than a user's server does (training/served.py).
    def in_this_process(*_args: object, **_kwargs: object) -> None:
        pytest.fail("the served figure ran in the training process")

    monkeypatch.setattr(served_module, "served_figures", in_this_process)
    out = tmp_path / "head"
    assert main(["train-drafter", "--tokens", "512", "--updates", "4", "--max-prompts", "2",
                 "--draft-vocab-size", "256", "--num-speculative-tokens", "2",
                 "--served-prompts", "1", "--served-max-tokens", "16", "--loss", "kl",
                 "--lr", "2e-3", "--no-progress",
                 "--weight-decay", "0.01", "--head-layers", "2", "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_windows"] == 4 and metrics["updates"] == 4 and metrics["lr"] == 2e-3
    assert metrics["loss"] == "kl" and metrics["data_answer_tokens"] > 0
    assert metrics["weight_decay"] == 0.01  # the option reaches the training config
    assert metrics["head_layers"] == 2  # ... and this one the head (served below)
    served = metrics["served"]  # the head served on a held-out instruction
    assert served["lossless"] and served["draft_tokens"] > 0
    assert served["max_tokens"] == 16  # --served-max-tokens reaches the child process
    assert len(served["acceptance_per_position"]) == 2 and served["speedup_vs_off"] > 0
    # ... and the tok/s a user gets who only names the method (the default policy).
    assert served["default_policy"] == "goodput"
    assert served["speedup_vs_off_default_policy"] > 0
    # ... and the tok/s of one who asks for trees (lossless above covers them too).
    tree = served["tree"]
    assert tree["k"] == 6 + 3 and tree["verifications"] > 0 and tree["speedup_vs_off"] > 0
    assert len(metrics["held_out_agreement_per_step"]) == 2
    assert metrics["expected_acceptance_length"] >= 1
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 256 and config["num_hidden_layers"] == 2

    monkeypatch.setattr(drafter, "trained_head_dir", lambda _path, method: out)
    params = SamplingParams(max_tokens=8)
    llm = LLM(loaded_model=default_model(), num_kv_blocks=16, max_model_len=128,
              speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    head = llm.engine.runner.spec.drafter.net  # type: ignore[union-attr]
    assert head.lm_head.weight.shape[0] == 256  # the trained head, not a random one
    assert head.num_layers == 2 and len(llm.engine.runner.spec.drafter.kv_caches) == 2
    off = LLM(loaded_model=default_model(), num_kv_blocks=16, max_model_len=128)
    prompt = ["def add(a, b):"]
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == \
        off.generate(prompt, params)[0].outputs[0].token_ids


def test_a_checkpoint_of_another_run_is_not_resumed(data: tuple[Batch, Batch, torch.Tensor],
                                                    tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Training into a directory that holds another run's checkpoint (other data or
    settings) starts over: resuming it served a head whose draft ids mapped through
    another vocabulary (first-draft acceptance 0.01, measured). The same run resumes."""
    train, _, d2t = data
    config = TrainConfig(updates=8, batch_size=4, lr=2e-3, depth=2, seed=3,
                         checkpoint_every=4)
    ckpt = tmp_path / "c.pt"
    train_head(fresh_head(d2t), train, config, checkpoint=ckpt, progress=False,
               stop_at=4, run_key="old")
    fresh = fresh_head(d2t)
    train_head(fresh, train, config, progress=False, run_key="new")
    other = fresh_head(d2t)
    with caplog.at_level("WARNING", logger="specbudget.training"):
        losses = train_head(other, train, config, checkpoint=ckpt, progress=False,
                            run_key="new")
    assert len(losses) == 8 and "another run" in caplog.text
    for (name, a), (_, b) in zip(fresh.state_dict().items(), other.state_dict().items(),
                                 strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
    same = fresh_head(d2t)  # the run that wrote it resumes: only what is left runs
    assert len(train_head(same, train, config, checkpoint=ckpt, progress=False,
                          run_key="new")) == 0


def test_weight_decay_shrinks_the_trained_weights(data: tuple[Batch, Batch, torch.Tensor]) -> None:
    """`weight_decay` reaches AdamW: the same run with it ends with smaller trainable
    weights than without."""
    train, _, d2t = data

    def norm(weight_decay: float) -> float:
        head = fresh_head(d2t)
        config = TrainConfig(updates=12, batch_size=4, lr=2e-3, depth=2, seed=3,
                             weight_decay=weight_decay)
        train_head(head, train, config, progress=False)
        return float(sum(p.detach().float().pow(2).sum() for p in head.parameters()
                         if p.requires_grad))

    assert norm(5.0) < 0.95 * norm(0.0)


def test_the_fused_optimiser_steps_as_the_unfused_one() -> None:
    """`adamw` as `train_head` runs it (fused) moves the weights as AdamW's unfused step
    does, weight decay included, and does move them."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 32, generator=generator), torch.randn(32, generator=generator)]
    config = TrainConfig(lr=1e-2, weight_decay=0.1)
    ends = []
    for fused in (True, False):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opt = adamw(params, config, fused=fused)
        for step in range(3):
            for p in params:
                p.grad = torch.sin(p.detach() * (step + 1))
            opt.step()
        ends.append([p.detach() for p in params])
    for fused_end, unfused_end, begin in zip(*ends, start, strict=True):
        assert torch.allclose(fused_end, unfused_end, atol=1e-6)
        assert not torch.allclose(fused_end, begin, atol=1e-3)


def test_the_head_starts_as_the_target_layer_it_reads_last() -> None:
    """`init_from_target` (layer on, the command's default `--init target`): `fc` passes
    the input of the highest layer the head reads through, and the decoder layer is
    that target layer (its attention reading the hidden half; the embedding half a
    tenth of the random start). With `layer` off the layer keeps its random start."""
    model = default_model()
    config = Eagle3Config.for_target(model.config, DRAFT_VOCAB)
    d2t = torch.zeros(DRAFT_VOCAB, dtype=torch.int64)
    top = max(config.aux_layer_ids)
    block = config.aux_layer_ids.index(top)
    source = model.model.layers[top]
    width = model.config.hidden_size
    aux = torch.randn(5, len(config.aux_layer_ids) * width)

    def started(layer: bool) -> Eagle3Head:
        head = Eagle3Head(config, model, seed=0)
        init_from_target(head, model, d2t, layer=layer)
        return head.float()

    head, random = started(True), started(False)
    torch.testing.assert_close(head.fc(aux), aux[:, block * width:(block + 1) * width],
                               rtol=0, atol=0)
    assert not torch.allclose(random.fc(aux), aux[:, block * width:(block + 1) * width])
    mid, rand_mid = head.midlayer, random.midlayer
    x = torch.randn(5, width)
    # From the weights: the target is shared by the module's tests (and may be packed).
    gate, up, down = (getattr(source.mlp, n).weight.float()
                      for n in ("gate_proj", "up_proj", "down_proj"))
    want = torch.nn.functional.silu(x @ gate.T) * (x @ up.T) @ down.T
    torch.testing.assert_close(mid.mlp(x), want)
    for name in ("q_proj", "k_proj", "v_proj"):
        ours, theirs = getattr(mid.self_attn, name).weight, getattr(source.self_attn, name)
        torch.testing.assert_close(ours[:, width:], theirs.weight.float(), rtol=0, atol=0)
        torch.testing.assert_close(ours[:, :width],
                                   0.1 * getattr(rand_mid.self_attn, name).weight[:, :width])
    torch.testing.assert_close(mid.self_attn.o_proj.weight, source.self_attn.o_proj.weight.float(),
                               rtol=0, atol=0)
    torch.testing.assert_close(mid.hidden_norm.weight, source.input_layernorm.weight.float(),
                               rtol=0, atol=0)
    assert not torch.allclose(rand_mid.mlp.down_proj.weight, mid.mlp.down_proj.weight)


def test_a_deeper_heads_later_layers_start_as_the_target_layers_after_it() -> None:
    """`--head-layers 3` from the target: the head's layers are the target's 27, 28
    and 29, so it starts as the target does from layer 27 on; without the layer init
    its later layers keep their random start."""
    model = default_model()
    config = Eagle3Config.for_target(model.config, DRAFT_VOCAB, 3)
    d2t = torch.zeros(DRAFT_VOCAB, dtype=torch.int64)
    top = max(config.aux_layer_ids)
    for layer in (True, False):
        head = Eagle3Head(config, model, seed=0)
        init_from_target(head, model, d2t, layer=layer)
        assert len(head.extra_layers) == 2
        for i, extra in enumerate(head.extra_layers, start=1):
            source = model.model.layers[top + i].state_dict()
            same = {name: torch.equal(w.float(), source[name].float())
                    for name, w in extra.state_dict().items()}
            if layer:
                assert all(same.values()), (i, same)
            else:
                assert not same["self_attn.q_proj.weight"] and not same["mlp.down_proj.weight"]


def test_the_start_is_the_methods_measured_default_unless_asked() -> None:
    """`--init` unset: dflash starts random (from the target's layer its second draft
    served 0.06 against 0.11, README), every other method from the target's layer; a
    given `--init` is kept."""
    assert head_init("dflash", None) == "random"
    assert {head_init(m, None) for m in ("eagle", "mtp", "parallel")} == {"target"}
    assert head_init("dflash", "target") == "target"
    assert head_init("eagle", "random") == "random"


def test_the_data_phase_runs_on_the_fastest_kernel_and_hands_back_the_serving_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The data needs no row to keep its bits across calls of other widths, so it runs
    on the fastest kernel; the served figure after it checks lossless serving, so the
    engine's row-invariant kernel comes back, also when the data phase fails."""
    import argparse

    from runner.models.kernel_select import select_linear_kernel
    from runner.models.linear import KernelChoice, TorchLinear
    from runner.models.llama import LlamaConfig, LlamaForCausalLM
    from training import pipeline

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=64, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    serving = select_linear_kernel(torch.float32, "cpu", (64, 128))
    model.pack(serving)
    fastest = KernelChoice(TorchLinear(), False)  # stands in for whatever is fastest here
    monkeypatch.setattr(pipeline, "fastest_linear_kernel", lambda *_: fastest)
    seen = []

    def data(*_args: object) -> dict[str, tuple]:
        seen.append(model.kernel_choice)
        if len(seen) == 2:
            raise RuntimeError("the data phase failed")
        return {}

    monkeypatch.setattr(pipeline, "self_distilled_data", data)
    args = argparse.Namespace()
    assert pipeline.data_with_fastest_kernel(None, model, args, (0, 1), Path(".")) == {}
    assert seen == [fastest] and model.kernel_choice is serving
    with pytest.raises(RuntimeError, match="failed"):
        pipeline.data_with_fastest_kernel(None, model, args, (0, 1), Path("."))
    assert seen[-1] is fastest and model.kernel_choice is serving
    # An unpacked model has no serving kernel to hand back: it is left unpacked.
    unpacked = LlamaForCausalLM(config).eval()
    monkeypatch.setattr(pipeline, "self_distilled_data",
                        lambda *_: seen.append(unpacked.kernel_choice) or {})
    assert pipeline.data_with_fastest_kernel(None, unpacked, args, (0, 1), Path(".")) == {}
    assert seen[-1] is None and unpacked.kernel_choice is None
