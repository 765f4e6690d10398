"""The engine's one frozen config: what the user sets, validated at start."""

from __future__ import annotations

from dataclasses import dataclass

from runner.config import RunnerConfig
from scheduler import SchedulerConfig
from spec_decode import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` and `specbudget serve` take; split into the parts' configs."""

    model: str | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    max_model_len: int = 2048
    block_size: int = 16
    kv_cache_memory_bytes: int = 256 << 20
    # Fixes the KV block count instead of deriving it from kv_cache_memory_bytes
    # (tests that need a tiny pool; vLLM's num_gpu_blocks_override).
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    device: str = "cpu"
    dtype: str = "auto"
    attention_backend: str = "auto"
    quantization: str | None = None
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        # Checked here as well as in CacheConfig: the runner divides by the block size
        # before any CacheConfig exists.
        for name in ("block_size", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                               self.max_model_len, self.enable_chunked_prefill, self.policy)

    def runner_config(self) -> RunnerConfig:
        return RunnerConfig(self.model, self.device, self.dtype, self.attention_backend,
                            self.kv_cache_memory_bytes, self.quantization)
