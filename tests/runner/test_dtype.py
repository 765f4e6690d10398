"""`dtype="auto"`: bfloat16 only where the hardware computes it natively."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from runner.config import RunnerConfig
from runner.dtype import cpu_flags, resolve_dtype
from specbudget import cli


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, "bfloat16"),
    ({"avx2", "amx_bf16", "amx_tile"}, "bfloat16"),
    ({"avx2", "fma", "avx512f", "avx512bw"}, "float32"),  # AVX-512 without bf16 dot products
    (set(), "float32"),
])
def test_auto_picks_bf16_only_with_native_support(flags: set[str], expected: str) -> None:
    choice = resolve_dtype("auto", "cpu", frozenset(flags))
    assert choice.dtype == expected
    assert choice.reason.startswith("auto:")


def test_auto_on_cuda_and_explicit_choices() -> None:
    assert resolve_dtype("auto", "cuda:0", frozenset()).dtype == "bfloat16"
    for name in ("float32", "float16", "bfloat16"):
        choice = resolve_dtype(name, "cpu", frozenset({"avx512_bf16"}))
        assert (choice.dtype, choice.reason) == (name, "set by the user")


def test_cpu_flags_reads_the_first_processor(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_auto_is_the_default_everywhere_and_resolves_on_this_machine() -> None:
    assert RunnerConfig().dtype == EngineConfig().dtype == "auto"
    assert cli._parser().parse_args(["serve"]).dtype == "auto"
    native = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert RunnerConfig().torch_dtype == (torch.bfloat16 if native else torch.float32)


def test_unknown_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"RunnerConfig\.dtype must be auto or one of "
                                         r"float32, float16, bfloat16, got 'int4'"):
        RunnerConfig(dtype="int4")


def test_int8_quantization_config() -> None:
    """int8 runs float32 activations on the CPU; what cannot run is refused by name."""
    config = RunnerConfig(quantization="int8")
    assert config.torch_dtype == torch.float32
    assert "int8 weights take float32 activations" in config.dtype_choice.reason
    assert EngineConfig(quantization="int8").runner_config().quantization == "int8"
    assert cli._parser().parse_args(["serve", "--quantization", "int8"]).quantization == "int8"
    with pytest.raises(ValueError, match=r"RunnerConfig\.quantization must be None or int8, "
                                         "got 'int4'"):
        RunnerConfig(quantization="int4")
    with pytest.raises(ValueError, match="dtype must be auto or float32, got 'bfloat16'"):
        RunnerConfig(dtype="bfloat16", quantization="int8")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        RunnerConfig(device="cuda", quantization="int8")


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_a_loaded_model_sets_the_dtype_under_auto(weights: torch.dtype) -> None:
    """A model handed in keeps its dtype for the KV cache too: on a bf16-capable CPU
    "auto" alone would give a float32 model a bfloat16 cache (its first KV write then
    fails); an explicit dtype that disagrees with the weights is refused by name."""
    from types import SimpleNamespace

    from runner.model_runner import _adopt_model_dtype

    model = SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(1, dtype=weights)))
    name = str(weights).removeprefix("torch.")
    adopted = _adopt_model_dtype(RunnerConfig(dtype="auto"), model)  # type: ignore[arg-type]
    assert adopted.torch_dtype == weights
    assert _adopt_model_dtype(RunnerConfig(dtype=name), model) \
        == RunnerConfig(dtype=name)  # type: ignore[arg-type]
    other = "float16"
    with pytest.raises(ValueError, match=rf"RunnerConfig.dtype='{other}', but the loaded "
                                         rf"model's weights are {name}"):
        _adopt_model_dtype(RunnerConfig(dtype=other), model)  # type: ignore[arg-type]
