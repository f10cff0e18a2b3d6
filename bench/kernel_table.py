"""The kernels a piece of GPU work runs, by device time (torch.profiler): name, calls, total and mean
microseconds, and each one's share of the summed kernel time. A help for reading a benchmark, not a
measurement: the profiler adds its own overhead to the host, not to the kernels.

Imports: stdlib and torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch


def kernel_table(work: Callable[[], object], title: str, rows: int = 24, busy: bool = False) -> str:
    """Run `work` once under the profiler (CUDA activity only) and format its kernels, longest first; with
    `busy`, also the wall time and how much of it the GPU ran any kernel (the union of their intervals)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            work()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kernels = [(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0), e.count, e.key)
                   for e in prof.key_averages()]
        kernels = sorted((k for k in kernels if k[0] > 0), reverse=True)
        total = sum(k[0] for k in kernels) or 1.0
        lines = [f"{title}: {total / 1e3:.2f} ms of kernels"]
        if busy:
            ran, long_gaps = busy_us(prof.events())
            longest = sorted(long_gaps, key=lambda gap: -gap[1])[:8]
            lines[0] += (f", GPU busy {ran / 1e3:.1f} ms of {wall * 1e3:.1f} ms wall ({ran / 1e4 / wall:.1f}%); idle in "
                         f"{len(long_gaps)} gaps of 1 ms or more: {sum(g for _, g in long_gaps) / 1e3:.1f} ms, longest "
                         + ", ".join(f"{g / 1e3:.1f} (at {at / 1e3:.0f})" for at, g in longest) + " ms")
        lines += [f"{us / 1e3:8.2f} ms {100 * us / total:5.1f}% {n:5d} x {us / n:8.1f} us  {key[:110]}"
                  for us, n, key in kernels[:rows]]
        return "\n".join(lines)
    except Exception as exc:  # noqa: BLE001 - the profiler is a help, not the measurement
        return f"{title}: profiler failed: {type(exc).__name__}: {exc}"


def busy_us(events: Iterable[Any], long_gap_us: float = 1000.0) -> tuple[float, list[tuple[float, float]]]:
    """Microseconds in which at least one device kernel ran (the union of the kernels' intervals), and the
    idle gaps between them of `long_gap_us` or more: (start after the first kernel's, length)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start)
    ran, reach, gaps = 0.0, None, []
    for start, end in spans:
        if reach is not None and start - reach >= long_gap_us:
            gaps.append((reach - spans[0][0], start - reach))
        if reach is None or end > reach:
            ran += end - (start if reach is None else max(start, reach))
            reach = end
    return ran, gaps
