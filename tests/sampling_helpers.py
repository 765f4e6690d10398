"""What the sampler and rejection-sampler tests share: SamplingMetadata straight from
SamplingParams (the runner builds it from its per-row arrays; spec_decode, below the
scheduler, never sees SamplingParams), and a chi-square goodness-of-fit test."""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

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


def chi2_critical(df: int, alpha: float) -> float:
    """Upper-alpha chi-square quantile by the Wilson–Hilferty cube approximation."""
    z = NormalDist().inv_cdf(1.0 - alpha)
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_statistic(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's statistic over the support; a draw outside the support is infinite."""
    observed = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * tokens.numel()
    support = expected > 0
    if bool((observed[~support] > 0).any()):
        return math.inf
    return float(((observed - expected)[support] ** 2 / expected[support]).sum())
