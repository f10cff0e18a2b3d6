"""The kernels a piece of GPU work runs, by device time (torch.profiler): name, calls, total and mean
microseconds, and each one's share of the summed kernel time. A help for reading a benchmark, not a
measurement: the profiler adds its own overhead to the host, not to the kernels.

Imports: stdlib and torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def kernel_table(work: Callable[[], object], title: str, rows: int = 24) -> str:
    """Run `work` once under the profiler (CUDA activity only) and format its kernels, longest first."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            work()
            torch.cuda.synchronize()
        kernels = [(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0), e.count, e.key)
                   for e in prof.key_averages()]
        kernels = sorted((k for k in kernels if k[0] > 0), reverse=True)
        total = sum(k[0] for k in kernels) or 1.0
        lines = [f"{title}: {total / 1e3:.2f} ms of kernels"]
        lines += [f"{us / 1e3:8.2f} ms {100 * us / total:5.1f}% {n:5d} x {us / n:8.1f} us  {key[:110]}"
                  for us, n, key in kernels[:rows]]
        return "\n".join(lines)
    except Exception as exc:  # noqa: BLE001 - the profiler is a help, not the measurement
        return f"{title}: profiler failed: {type(exc).__name__}: {exc}"
