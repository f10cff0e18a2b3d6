"""The rollout timeline as a picture: router weights, request rate, error rate and latency percentiles per
version over time, with the analyses marked (green Successful, orange Inconclusive, red Failed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tasks.analysis import AnalysisResult
from tasks.gray_release import RolloutReport


def _bins(end: float) -> tuple[float, int]:
    width = max(0.5, math.ceil(end / 60 * 2) / 2)  # about 60 bins, at least half a second
    return width, int(end // width) + 1


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _legend(ax: Any, **kwargs: Any) -> None:
    """A legend where the panel has labelled lines (a panel with no answered request has none)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def analysis_label(analysis: AnalysisResult) -> str:
    """What a dashed analysis line says: its outcome and, per latency metric, judged or why not."""
    parts = []
    for c in analysis.comparisons:
        if c.judged:
            parts.append(f"{c.metric} {c.ratio:.2f}x")
        elif c.outcome == "Inconclusive":
            parts.append(f"{c.metric} NOT JUDGED")
        else:
            parts.append(f"{c.metric} not compared")
    return f"{analysis.outcome} ({analysis.window_s:.0f} s)" + (": " + ", ".join(parts) if parts else "")


def plot_timeline(report: RolloutReport, path: Path) -> Path:
    """Save a four-panel timeline as PNG and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = report.records
    end = max([r.started_s + r.latency_s for r in records] + [c.t_s for c in report.weight_changes] + [1.0])
    width, n = _bins(end)
    versions = sorted({v for c in report.weight_changes for v in c.weights} | {r.version for r in records if r.version})
    fig, (ax_w, ax_rate, ax_err, ax_lat) = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
    xs_bins = [(i + 0.5) * width for i in range(n)]
    for version in versions:
        xs, ys = [0.0], [100 if version == report.live else 0]  # before the first step: live takes all
        for change in report.weight_changes:
            xs += [change.t_s, change.t_s]
            ys += [ys[-1], change.weights.get(version, 0)]
        xs.append(end)
        ys.append(ys[-1])
        (line,) = ax_w.plot(xs, ys, label=f"version {version}")
        color = line.get_color()
        mine = [r for r in records if r.version == version]
        counts = [0] * n
        lat: list[list[float]] = [[] for _ in range(n)]
        for r in mine:
            i = int(r.started_s // width)
            counts[i] += 1
            if r.ok:
                lat[i].append(r.latency_s * 1e3)
        ax_rate.plot(xs_bins, [c / width for c in counts], color=color, label=f"version {version}")
        p50 = [(x, _percentile(v, 0.5)) for x, v in zip(xs_bins, lat) if v]
        p99 = [(x, _percentile(v, 0.99)) for x, v in zip(xs_bins, lat) if v]
        if p50:
            ax_lat.plot(*zip(*p50), color=color, label=f"v{version} p50")
            ax_lat.plot(*zip(*p99), color=color, linestyle=":", label=f"v{version} p99")
    failed_by_bin = [0] * n
    total_by_bin = [0] * n
    for r in records:
        i = int(r.started_s // width)
        total_by_bin[i] += 1
        failed_by_bin[i] += not r.ok
    ax_err.plot(xs_bins, [f / t if t else 0.0 for f, t in zip(failed_by_bin, total_by_bin)], color="red")
    for analysis in report.analyses:
        color = {"Successful": "green", "Failed": "red"}.get(analysis.outcome, "orange")
        for ax in (ax_w, ax_rate, ax_err, ax_lat):
            ax.axvline(analysis.t_s, color=color, alpha=0.5, linestyle="--")
        # inside the weight panel, clipped to it and left out of the layout (a long label would push the
        # panels apart)
        ax_w.text(analysis.t_s, 0.97, analysis_label(analysis), color=color, fontsize=6, rotation=90, ha="right",
                  va="top", transform=ax_w.get_xaxis_transform(), clip_on=True, in_layout=False)
    ax_w.set_ylabel("router weight %")
    ax_w.set_ylim(-5, 105)
    _legend(ax_w, loc="center right", fontsize=8)
    ax_rate.set_ylabel("requests/s")
    _legend(ax_rate, loc="upper right", fontsize=8)
    ax_err.set_ylabel("error rate")
    ax_err.set_ylim(-0.05, 1.05)
    ax_lat.set_ylabel("latency ms")
    _legend(ax_lat, loc="upper right", fontsize=7, ncol=2)
    ax_lat.set_xlabel(f"seconds since rollout start ({width:g} s bins; dashed: analyses, green passed, "
                      "orange inconclusive, red failed)")
    failed = sum(not r.ok for r in records)
    replacing = f"replacing version {report.live}" if report.live is not None else "first live version"
    fig.suptitle(f"{report.model_name}: rollout of version {report.candidate} ({replacing}): {report.outcome}"
                 f" ({len(records)} requests, {failed} failed)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
