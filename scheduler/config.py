"""Frozen, validated configs for the scheduler and the KV cache.

Values found at run time (the number of KV blocks a memory budget buys, the EOS id)
never get written back into these: they travel in separate result objects.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step.

    `max_num_batched_tokens` (B) bounds the rows of every forward pass the step runs,
    the target's and each drafter pass alike. `long_prefill_token_threshold` (0 = off)
    caps one request's chunk so a long prompt cannot take the whole step.
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1 (got {getattr(self, name)})")
        if self.policy not in POLICIES:
            raise ValueError(
                f"SchedulerConfig.policy={self.policy!r} is not supported; choose one of "
                f"{', '.join(POLICIES)}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "SchedulerConfig.long_prefill_token_threshold must be >= 0 (0 = off), got "
                f"{self.long_prefill_token_threshold}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "SchedulerConfig.max_num_batched_tokens must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill=False, got "
                f"{self.max_num_batched_tokens}: a whole prompt must fit in one step"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape: `num_blocks` blocks of `block_size` token slots each."""

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"CacheConfig.block_size must be >= 1 (got {self.block_size})")
        if self.num_blocks < 1:
            raise ValueError(f"CacheConfig.num_blocks must be >= 1 (got {self.num_blocks})")
