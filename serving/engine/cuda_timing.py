"""Kernel timing the way a decode step meets kernels: calls captured in one CUDA graph, replayed.

Imports: stdlib and torch only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_time_us(fn: Callable[..., object], *args: object, calls: int = 50, replays: int = 10,
                  warmup: int = 3) -> float:
    """Microseconds per `fn(*args)`: `warmup` calls on a side stream, then `calls` calls captured in one
    CUDA graph, replayed `replays` times between two events (launch cost as inside the decode graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(stop) * 1000.0 / (calls * replays)
