"""The rollout timeline as a picture: router weights, request latencies per version, failures."""

from __future__ import annotations

from pathlib import Path

from tasks.gray_release import RolloutReport


def plot_timeline(report: RolloutReport, path: Path) -> Path:
    """Save a three-panel timeline (weights, latency per version, failures) as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_w, ax_lat, ax_err) = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    end = max([r.started_s + r.latency_s for r in report.records] + [c.t_s for c in report.weight_changes] + [1.0])
    versions = sorted({v for c in report.weight_changes for v in c.weights} | {r.version for r in report.records if r.version})
    for version in versions:
        xs, ys = [0.0], [0]
        for change in report.weight_changes:
            xs += [change.t_s, change.t_s]
            ys += [ys[-1], change.weights.get(version, 0)]
        xs.append(end)
        ys.append(ys[-1])
        ax_w.plot(xs, ys, label=f"version {version}")
        mine = [r for r in report.records if r.version == version and r.ok]
        ax_lat.scatter([r.started_s for r in mine], [r.latency_s * 1e3 for r in mine], s=6, label=f"version {version}")
    for analysis in report.analyses:
        color = {"Successful": "green", "Failed": "red"}.get(analysis.outcome, "orange")
        for ax in (ax_w, ax_lat, ax_err):
            ax.axvline(analysis.t_s, color=color, alpha=0.4, linestyle="--")
    failed = [r for r in report.records if not r.ok]
    ax_err.scatter([r.started_s for r in failed], [1] * len(failed), marker="x", color="red")
    ax_w.set_ylabel("weight %")
    ax_w.set_ylim(-5, 105)
    ax_w.legend(loc="center right")
    ax_lat.set_ylabel("latency ms")
    ax_lat.legend(loc="upper right")
    ax_err.set_ylabel("failed")
    ax_err.set_yticks([])
    ax_err.set_xlabel("seconds since rollout start (dashed: analyses; green passed, red failed)")
    fig.suptitle(
        f"{report.model_name}: rollout of version {report.candidate} over {report.live}: {report.outcome}"
        f" ({len(report.records)} requests, {len(failed)} failed)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
