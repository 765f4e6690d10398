"""Load an HF-style checkpoint directory (config.json + *.safetensors) into a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from runner.models.llama import LlamaConfig, LlamaForCausalLM

# Architectures whose weights and maths are exactly Llama's.
_LLAMA_ARCHITECTURES = {"LlamaForCausalLM"}


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint dir."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face-style checkpoint")
    return dict(json.loads(config_path.read_text(encoding="utf-8")))


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Build the model from `path`/config.json and load every `*.safetensors` in `path`."""
    from safetensors.torch import load_file

    path = Path(path)
    hf_config = read_config(path)
    archs = hf_config.get("architectures") or [hf_config.get("model_type", "?")]
    if not set(archs) & _LLAMA_ARCHITECTURES and hf_config.get("model_type") != "llama":
        raise ValueError(f"{path}: architecture {archs} is not supported "
                         f"(supported: {sorted(_LLAMA_ARCHITECTURES)})")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    config = LlamaConfig.from_hf(hf_config)
    # Built on the meta device: no time spent on random init of weights about to be
    # overwritten, and no second copy of them in memory.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    model.load_weights(state)
    return model.eval()


def pack_for_inference(model: LlamaForCausalLM, device: str | torch.device,
                       quantization: str | None = None) -> LlamaForCausalLM:
    """Pack the model's linear layers for the fastest row-invariant kernel here
    (runner/models/kernel_select.py); a model already packed keeps its kernel, and must
    have been packed for the same quantization (it may be shared with another engine)."""
    from runner.models.kernel_select import select_linear_kernel

    if model.kernel_choice is None:
        model.pack(select_linear_kernel(model.lm_head.weight.dtype, device,
                                        model.config.reduction_widths, quantization))
    elif model.kernel_choice.kernel.quantization != quantization:
        raise ValueError(f"the loaded model is packed for quantization="
                         f"{model.kernel_choice.kernel.quantization}, this engine asks for "
                         f"quantization={quantization}: give it a model of its own")
    return model
