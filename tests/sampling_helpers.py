"""SamplingMetadata straight from SamplingParams, for sampler tests (the runner builds
it from its per-row arrays; spec_decode, below the scheduler, never sees SamplingParams)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from scheduler import SamplingParams
from spec_decode.sampling import SamplingMetadata


def sampling_metadata(params: Sequence[SamplingParams], seeds: dict[int, int] | None = None,
                      device: torch.device | str = "cpu",
                      positions: np.ndarray | None = None) -> SamplingMetadata:
    """Metadata for rows `params[0..N)`; `seeds` is keyed by row."""
    num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata.from_arrays(
        temperature=np.array([p.temperature for p in params], dtype=np.float32),
        top_p=np.array([p.top_p for p in params], dtype=np.float32),
        top_k=np.array([p.top_k for p in params], dtype=np.int64),
        min_p=np.array([p.min_p for p in params], dtype=np.float32),
        seeds=seeds or {},
        max_num_logprobs=max(num_logprobs) if num_logprobs else None,
        device=device,
        positions=positions,
    )
