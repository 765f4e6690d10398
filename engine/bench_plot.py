"""The serving benchmark's plot: one line per series on each latency/throughput panel."""

from __future__ import annotations

import math
from typing import Any

PLOT_PANELS = (("output_throughput", None, "output tokens/s"),
               ("ttft_ms", "p50", "TTFT p50 (ms)"),
               ("tpot_ms", "p50", "TPOT p50 (ms)"),
               ("e2e_ms", "p99", "e2e p99 (ms)"))


def _x(run: dict[str, Any]) -> float:
    if run["concurrency"] is not None:
        return float(run["concurrency"])
    rate = run["request_rate"]
    return math.inf if rate == "inf" else float(rate)


def plot_series(series: dict[str, list[dict[str, Any]]], path: str, title: str = "") -> None:
    """One line per series (e.g. speculation off / ngram) on each panel, PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PLOT_PANELS), figsize=(4.2 * len(PLOT_PANELS), 3.6))
    any_runs = next((runs for runs in series.values() if runs), [])
    by_rate = bool(any_runs) and any_runs[0]["concurrency"] is None
    for ax, (key, stat, label) in zip(axes, PLOT_PANELS):
        for name, runs in series.items():
            points = [(_x(r), r[key] if stat is None else r[key][stat]) for r in runs]
            points = [(x, y) for x, y in points if y is not None and math.isfinite(x)]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    label=_series_label(name, runs))
        ax.set_xlabel("request rate (req/s)" if by_rate else "concurrency")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ticks = sorted({x for runs in series.values() for r in runs if math.isfinite(x := _x(r))})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _series_label(name: str, runs: list[dict[str, Any]]) -> str:
    drafted = sum((r["spec_decode"] or {}).get("num_draft_tokens", 0) for r in runs)
    accepted = sum((r["spec_decode"] or {}).get("num_accepted_tokens", 0) for r in runs)
    return f"{name} (acceptance {accepted / drafted:.2f})" if drafted else name
