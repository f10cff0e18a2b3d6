"""Plots of benchmark reports: the served run's latency distributions (TTFT, TPOT per request, gaps
between responses). `python3 -m bench plot --served served.json --out served.png`.

Imports: stdlib at import time; matplotlib inside the function (not needed to serve).
"""

from __future__ import annotations

import json
from pathlib import Path


def plot_served(report_path: Path, out_png: Path, *, variant: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(report_path).read_text())
    if variant is not None:
        if variant not in report.get("variants", {}):
            raise ValueError(f"variant={variant!r} is not in {report_path} (it has {sorted(report.get('variants', {}))})")
        report = {**report, **report["variants"][variant]}
    samples = report["samples"]
    panels = [("ttft_ms", "TTFT (send -> first token), ms"),
              ("tpot_ms", "TPOT per request, ms ((last - first) / (n - 1))"),
              ("itl_ms", "gap between a stream's responses, ms")]
    panels = [(key, title) for key, title in panels if samples.get(key)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (key, title) in zip(axes if len(panels) > 1 else [axes], panels):
        values = samples[key]
        ax.hist(values, bins=60, color="#4878a8")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("requests" if key != "itl_ms" else "gaps")
        for q, style in ((50, "-"), (99, "--")):
            v = sorted(values)[min(len(values) - 1, int(len(values) * q / 100))]
            ax.axvline(v, color="black", linestyle=style, linewidth=1, label=f"p{q} {v:.1f}")
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['shape']}, {report['clients']} streaming clients, {report['prompt_len']}/"
                 f"{report['gen_len']}: {report['output_tok_s']:,.0f} output tok/s, "
                 f"{report.get('tokens_per_response', 1):.1f} tokens per response", fontsize=10)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
