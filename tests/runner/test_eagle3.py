"""The EAGLE-3 head: a checkpoint written by hand in the published layout (the tensor
names and config fields a real EAGLE-3 head for a Llama target carries) loads, drafts
target ids through its d2t map, and serves; the target exposes the three layers' inputs
it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from runner.draft_gate import TRAINED_HEAD_MIN_CONFIDENCE
from runner.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    default_aux_layers,
    load_eagle3,
    measured_acceptance,
    save_eagle3,
)
from runner.models.llama import LlamaForCausalLM
from scheduler import SamplingParams
from scheduler.config import GoodputSettings
from tests.server_helpers import default_model

pytestmark = pytest.mark.model  # loads the real default model

DRAFT_VOCAB = 64


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return default_model()


def write_published_layout(path: Path, target: LlamaForCausalLM, aux: list[int]) -> None:
    """config.json and model.safetensors named as published EAGLE-3 heads name them."""
    from safetensors.torch import save_file

    c = target.config
    hidden, heads, kv, dim = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, \
        c.head_dim
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": 256, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": dim,
        "rms_norm_eps": 1e-5, "rope_theta": c.rope_theta, "vocab_size": c.vocab_size,
        "draft_vocab_size": DRAFT_VOCAB, "max_position_embeddings": 2048,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv * dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv * dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * dim),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.mlp.gate_proj.weight": rand(256, hidden),
        "midlayer.mlp.up_proj.weight": rand(256, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, 256),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(DRAFT_VOCAB, hidden),
        # Draft id i is target token 1000 + 7i: offsets, as EAGLE-3 stores them.
        "d2t": torch.arange(DRAFT_VOCAB) * 6 + 1000,
        "t2d": torch.zeros(c.vocab_size, dtype=torch.bool),
    }
    save_file(tensors, str(path / "model.safetensors"))


def test_published_layout_loads_and_maps_draft_ids(model: LlamaForCausalLM,
                                                   tmp_path: Path) -> None:
    write_published_layout(tmp_path / "head", model, [1, 10, 20])
    head = load_eagle3(tmp_path / "head", model)
    assert head.head_config.aux_layer_ids == (1, 10, 20)
    assert head.lm_head.weight.shape == (DRAFT_VOCAB, model.config.hidden_size)
    ids = head.greedy_tokens(torch.randn(5, model.config.hidden_size))
    assert ((ids - 1000) % 7 == 0).all() and (ids < 1000 + 7 * DRAFT_VOCAB).all()


def test_published_layout_serves_losslessly(model: LlamaForCausalLM, tmp_path: Path) -> None:
    write_published_layout(tmp_path / "head", model, [2, 15, 27])
    params = SamplingParams(max_tokens=12)
    off = LLM(loaded_model=model, num_kv_blocks=16, max_model_len=128)
    (want,) = off.generate(["The capital of France is"], params)
    on = LLM(loaded_model=model, num_kv_blocks=16, max_model_len=128, speculative_config={
        "method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "head")})
    (got,) = on.generate(["The capital of France is"], params)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    drafted = on.get_metrics()["spec_decode"]["num_draft_tokens"]
    assert drafted > 0  # it really drafted (ids from its d2t map), and stayed lossless


def test_measured_acceptance_comes_from_the_head_dir(tmp_path: Path) -> None:
    """Served acceptance per position (metrics.json) becomes each position's share of
    those that reached it, positions reached under 5 % of the time dropped; without it
    the held-out agreement config.json carries; without either, or from a broken
    metrics.json, nothing (the generic prior then)."""
    head = tmp_path / "head"
    head.mkdir()
    assert measured_acceptance(head) is None
    (head / "config.json").write_text(json.dumps(
        {"specbudget": {"trained": {"held_out_agreement_per_step": [0.33, 0.28]}}}))
    assert measured_acceptance(head) == ((0.33, 0.28), 0, (), 0.0)  # no verification behind it
    (head / "metrics.json").write_text("{not json")
    assert measured_acceptance(head) == ((0.33, 0.28), 0, (), 0.0)
    (head / "metrics.json").write_text(json.dumps(
        {"served": {"acceptance_per_position": [0.4, 0.2, 0.04, 0.01], "k": 4,
                    "rounds": 2, "draft_tokens": 2524}}))
    got = measured_acceptance(head)
    assert got is not None
    assert got.rates == pytest.approx((0.4, 0.5, 0.2))
    assert got.verifications == 2524 // (4 * 2)  # one round's: the rounds repeat prompts
    assert got.proposal_rates == ()  # served without a gate: every chain to K
    (head / "metrics.json").write_text(json.dumps(
        {"served": {"acceptance_per_position": [0.4, 0.2], "k": 2, "draft_tokens": 20,
                    "proposal_rates": [1.0, 0.4]}}))
    assert measured_acceptance(head).proposal_rates == (1.0, 0.4)  # type: ignore[union-attr]


def test_engine_hands_the_heads_measured_acceptance_to_the_scheduler(
        model: LlamaForCausalLM, tmp_path: Path) -> None:
    """The goodput policy of an engine serving a head that came with its measured
    acceptance starts from it; one without starts from the generic prior."""
    write_published_layout(tmp_path / "head", model, [2, 15, 27])
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "head")}

    def prior(**options: float) -> tuple[list[float], float, list[float]]:
        llm = LLM(loaded_model=model, num_kv_blocks=16, max_model_len=128,
                  speculative_config={**spec, **options})
        policy = llm.engine.scheduler.policy  # type: ignore[union-attr]
        assert policy is not None
        assert policy.settings.step_prior == "cpu"  # the step-time prior by device
        return (policy.acceptance.pooled_rates().tolist(), policy.settings.prior_evidence,
                policy.proposals.rates.tolist())

    rates, evidence, reach = prior()
    assert rates == pytest.approx([GoodputSettings().prior_acceptance] * 3)
    assert evidence == 0 and reach == [1.0] * 3
    (tmp_path / "head" / "metrics.json").write_text(json.dumps(
        {"served": {"acceptance_per_position": [0.3, 0.15, 0.06], "k": 3, "rounds": 1,
                    "draft_tokens": 600, "proposal_rates": [1.0, 0.6, 0.3],
                    "min_draft_confidence": TRAINED_HEAD_MIN_CONFIDENCE}}))
    rates, evidence, reach = prior()
    assert rates == pytest.approx([0.3, 0.5, 0.4])
    assert evidence == 200
    assert reach == pytest.approx([1.0, 0.6, 0.3])  # how far its gated chains went
    # Served at another threshold, the chains stop elsewhere: no reach prior.
    assert prior(min_draft_confidence=0.0)[2] == [1.0] * 3
    assert prior(min_draft_confidence=0.5)[2] == [1.0] * 3


def test_head_for_another_target_is_refused(model: LlamaForCausalLM, tmp_path: Path) -> None:
    write_published_layout(tmp_path / "head", model, [1, 10, 40])
    with pytest.raises(ValueError, match=r"reads target layers \(1, 10, 40\); the target has 30"):
        load_eagle3(tmp_path / "head", model)


def test_a_deeper_head_keeps_every_layer(model: LlamaForCausalLM, tmp_path: Path) -> None:
    """A head of two decoder layers writes `num_hidden_layers` and both layers'
    weights, and loads them back; a checkpoint whose config says two layers but that
    carries one layer's weights, or says no layers, is refused by name."""
    head = Eagle3Head(Eagle3Config.for_target(model.config, DRAFT_VOCAB, 2), model, seed=0)
    save_eagle3(head, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    loaded = load_eagle3(tmp_path / "head", model)
    assert loaded.num_layers == 2
    want, got = head.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys() and any(k.startswith("extra_layers.0.") for k in got)
    assert all(torch.equal(want[k], got[k]) for k in want)

    write_published_layout(tmp_path / "one", model, [2, 15, 27])
    one = json.loads((tmp_path / "one" / "config.json").read_text())
    for layers, message in ((2, r"missing \['extra_layers\.0\."),
                            (0, "num_hidden_layers must be an integer >= 1, got 0"),
                            (True, "num_hidden_layers must be an integer >= 1, got True")):
        (tmp_path / "one" / "config.json").write_text(
            json.dumps({**one, "num_hidden_layers": layers}))
        with pytest.raises(ValueError, match=message):
            load_eagle3(tmp_path / "one", model)


def test_target_exposes_the_inputs_of_its_aux_layers(model: LlamaForCausalLM) -> None:
    """forward_with_aux's features are the inputs of layers (2, 15, 27), and its final
    hidden states are forward's."""
    assert default_aux_layers(30) == (2, 15, 27)
    llm = LLM(loaded_model=model, num_kv_blocks=16, max_model_len=128, speculative_config={
        "method": "eagle", "num_speculative_tokens": 2, "model": "random"})
    seen: list[torch.Tensor] = []
    hooks = [model.model.layers[i].register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].clone())) for i in (2, 15, 27)]
    features: list[torch.Tensor] = []
    real = model.forward_with_aux

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        hidden, aux = real(*args, **kwargs)
        features.append(aux)
        return hidden, aux

    model.forward_with_aux = spy  # type: ignore[method-assign]
    try:
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=1))
    finally:
        del model.forward_with_aux
        for hook in hooks:
            hook.remove()
    assert torch.equal(features[0], torch.cat(seen[:3], dim=-1))


@pytest.mark.parametrize("method", ["eagle", "parallel", "dflash"])
def test_a_head_method_without_a_trained_head_is_refused(
        method: str, model: LlamaForCausalLM, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No trained head in the cache and no "model": refused with the command that
    trains one and the way to ask for a random head; with "random", it serves."""
    import runner.drafter as drafter

    monkeypatch.setattr(drafter, "trained_head_dir", lambda _path, name: tmp_path / name)
    spec = {"method": method, "num_speculative_tokens": 2}
    with pytest.raises(drafter.NoTrainedHeadError) as err:
        LLM(loaded_model=model, num_kv_blocks=16, max_model_len=128, speculative_config=spec)
    message = str(err.value)
    assert f"specbudget train-drafter --method {method}" in message
    assert "about 30 minutes" in message and '"model": "random"' in message
    assert str(tmp_path / method) in message
    llm = LLM(loaded_model=model, num_kv_blocks=16, max_model_len=128,
              speculative_config={**spec, "model": "random"})
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0]
               .outputs[0].token_ids) == 3


@pytest.mark.parametrize("method", ["dflash", "eagle"])
def test_passes_that_read_out_no_draft_only_write_kv(model: LlamaForCausalLM,
                                                     method: str) -> None:
    """A drafter pass that reads out no draft runs only its KV writes
    (tests/runner/test_write_only_pass.py checks their bits): DFlash's context pass at
    every step that drafts, and for both methods a prompt chunk that does not sample.
    A pass that drafts runs whole: DFlash's query block once a step, eagle's passes
    once per draft."""
    llm = LLM(loaded_model=model, num_kv_blocks=32, max_model_len=256,
              max_num_batched_tokens=16, speculative_config={
                  "method": method, "num_speculative_tokens": 2, "model": "random",
                  "draft_policy": "fixed"})
    head = llm.engine.runner.spec.drafter.net
    calls = {"forward": 0, "write_kv": 0}

    def counted(name, real):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    head.forward = counted("forward", head.forward)
    head.write_kv = counted("write_kv", head.write_kv)
    # 40 prompt tokens in chunks of 16: two chunks that do not sample, then one that does.
    out = llm.generate([list(range(5, 45))], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 12
    spec = llm.get_metrics()["spec_decode"]
    steps, drafts = spec["num_drafts"], sum(spec["num_draft_tokens_per_pos"])
    assert steps >= 5
    if method == "dflash":
        assert calls == {"forward": steps, "write_kv": steps + 2}
    else:
        assert calls == {"forward": drafts, "write_kv": 2}


@pytest.mark.parametrize("method", ["eagle", "parallel"])
def test_readout_rows_alone_draft_as_the_whole_pass(model: LlamaForCausalLM,
                                                    method: str) -> None:
    """A pass split in two (every row's K/V, then its readout rows alone; by default
    past `SPLIT_MIN_SKIPPED` rows that read out nothing) drafts from the same hidden
    states, bit for bit, as the whole pass: every pass of this run runs both ways."""
    llm = LLM(loaded_model=model, num_kv_blocks=32, max_model_len=256,
              max_num_batched_tokens=32, speculative_config={
                  "method": method, "num_speculative_tokens": 3, "model": "random",
                  "draft_policy": "fixed"})
    drafter = llm.engine.runner.spec.drafter
    real = drafter._run
    split_rows: list[int] = []

    def both(draft_pass, res, hidden_in, direct_hidden=False, split=None):  # type: ignore[no-untyped-def]
        if direct_hidden or not len(draft_pass.readout):
            return real(draft_pass, res, hidden_in, direct_hidden, split)
        whole = real(draft_pass, res, hidden_in, split=False)
        alone = real(draft_pass, res, hidden_in, split=True)
        if draft_pass.readout_block() is not None:
            split_rows.append(draft_pass.num_rows)
        assert torch.equal(whole, alone)
        return alone

    drafter._run = both
    # Prompts of 40 and 11 tokens: a chunk of 32 that does not sample, then passes of
    # 8 and 11 rows that read out one each (parallel: and its mask rows), then decodes.
    outs = llm.generate([list(range(5, 45)), list(range(50, 61))],
                        SamplingParams(max_tokens=10, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [10, 10]
    assert len(split_rows) >= 5 and max(split_rows) >= 11


@pytest.mark.parametrize("method", ["eagle", "parallel", "dflash"])
def test_a_pass_runs_without_the_padding_over_rejected_drafts(
        model: LlamaForCausalLM, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A random head's drafts are nearly all rejected, so its passes as charged carry
    padding past each request's real rows: the drafter runs them without it
    (`DraftPass.without_padding`), and every readout row drafts from the same hidden
    state, bit for bit, as the pass with its padding (run again beside it here)."""
    from spec_decode.passes import DraftPass
    llm = LLM(loaded_model=model, num_kv_blocks=32, max_model_len=256,
              max_num_batched_tokens=32, speculative_config={
                  "method": method, "num_speculative_tokens": 3, "model": "random",
                  "draft_policy": "fixed"})
    drafter = llm.engine.runner.spec.drafter
    unpad, real = DraftPass.without_padding, drafter._run
    padded: dict[int, tuple[DraftPass, DraftPass]] = {}
    ran: list[tuple[int, int]] = []  # (rows charged, rows run) of each trimmed pass

    def recorded(self: DraftPass) -> DraftPass:
        run = unpad(self)
        if run is not self:
            padded[id(run)] = (run, self)
        return run

    def both(draft_pass, res, hidden_in, direct_hidden=False, split=None):  # type: ignore[no-untyped-def]
        out = real(draft_pass, res, hidden_in, direct_hidden, split)
        if id(draft_pass) in padded:
            full = padded.pop(id(draft_pass))[1]
            ran.append((full.num_rows, draft_pass.num_rows))
            want = real(full, res, hidden_in, direct_hidden, split)
            assert (out is None) == (want is None)
            assert out is None or torch.equal(out, want)
        return out

    monkeypatch.setattr(DraftPass, "without_padding", recorded)
    drafter._run = both
    prompts = [list(range(5, 45)), list(range(50, 61))]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    want = [o.outputs[0].token_ids
            for o in LLM(loaded_model=model, max_model_len=256).generate(prompts, params)]
    assert got == want
    assert len(ran) >= 5 and all(run < charged for charged, run in ran)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_packed_heads_rotations_come_from_its_table_bit_for_bit(
        model: LlamaForCausalLM, tmp_path: Path, dtype: torch.dtype) -> None:
    """The table of every position's rotation a packed head reads on the CPU gives
    `rope`'s bits at the first, a middle and the last position it holds; a position
    past it is computed as `rope` computes it."""
    from runner.eagle3 import ROTARY_TABLE_MAX
    from runner.models.llama import Rotary
    from tests.helpers import kernel_that_packs

    write_published_layout(tmp_path / "head", model, default_aux_layers(
        model.config.num_hidden_layers))
    head = load_eagle3(tmp_path / "head", model).to(dtype)
    head.pack(kernel_that_packs(dtype))
    last = min(head.config.max_position_embeddings, ROTARY_TABLE_MAX) - 1
    positions = torch.tensor([0, 7, 300, last, last + 5])
    got = head._rotary(positions, dtype)
    assert head._rotary_table is not None and len(head._rotary_table.cos) == last + 1
    want = Rotary.from_cos_sin(*head.rope(positions, dtype))
    assert torch.equal(got.cos, want.cos) and torch.equal(got.signed_sin, want.signed_sin)
    assert not torch.equal(got.cos[1:2], want.cos[2:3])  # positions are told apart
