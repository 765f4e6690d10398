"""Token sampler: greedy, temperature, top-k / top-p / min-p, per-request seeds, logprobs.

One `Sampler.forward` call samples one token for each of N rows (one row per request
that samples this step). Everything is vectorised over the batch except the draws of
seeded requests, which are made row by row from noise keyed by (seed, token position):
a seeded request's token then depends only on its own logits, seed and position, never
on which other requests share the batch, at which row it sits, or how many tokens
earlier steps drew.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_decode.sampling import (
    SAMPLING_EPS,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    exponential_race,
    greedy_ids,
)


@dataclass
class LogprobsTensors:
    """Logprobs of the raw logits (before temperature and filters), as in vLLM.

    Column 0 is the sampled token; columns 1..n are the top n tokens, most likely first.
    """

    token_ids: torch.Tensor  # [N, n + 1] int64
    logprobs: torch.Tensor  # [N, n + 1] fp32
    selected_token_ranks: torch.Tensor  # [N] int64, 1 = the most likely token


@dataclass
class SamplerOutput:
    """One sampled token per row, and its logprobs when any request asked for them."""

    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None


class Sampler:
    """Samples one token per row from [N, V] fp32 logits; never modifies the logits.

    Greedy rows take the argmax. Random rows: logits / T, then top-k, then top-p over
    the renormalised top k, then min-p, then one exponential-race draw per row.
    """

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # From the raw logits (before temperature and filters), as vLLM reports them.
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [N, V]
        if meta.all_greedy:
            sampled = greedy_ids(logits)  # [N]
        else:
            sampled = self._sample_random(logits, meta)  # [N]
            if not meta.all_random:
                greedy_rows = meta.temperature < SAMPLING_EPS  # [N]
                sampled = torch.where(greedy_rows, greedy_ids(logits), sampled)
        logprobs = None
        if raw_logprobs is not None and meta.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    __call__ = forward

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        # Greedy rows of a mixed batch run through with T = 1 (no division by zero);
        # their result is replaced by the argmax afterwards.
        temperature = torch.where(meta.temperature < SAMPLING_EPS, 1.0, meta.temperature)
        logits = logits / temperature.unsqueeze(1)  # [N, V], a copy: the input stays intact
        if not (meta.no_top_k and meta.no_top_p):
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        if not meta.no_min_p:
            logits = apply_min_p(logits, meta.min_p)
        probs = torch.softmax(logits, dim=-1)  # [N, V]
        keys = {row: (seed, int(meta.positions[row])) for row, seed in meta.seeds.items()}
        return exponential_race(probs, keys)


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """The sampled token's logprob and rank, then the top `num_logprobs` tokens."""
    sampled = sampled.unsqueeze(1)  # [N, 1]
    sampled_logprobs = raw_logprobs.gather(1, sampled)  # [N, 1]
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)  # [N, n], descending
    ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1  # [N]
    return LogprobsTensors(
        token_ids=torch.cat([sampled, top_ids], dim=1),
        logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1),
        selected_token_ranks=ranks,
    )
