"""Model architectures the runner can load (HF checkpoint layout)."""

from runner.models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["LlamaConfig", "LlamaForCausalLM"]
