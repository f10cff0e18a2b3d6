"""The bench's profiler summary (bench/kernel_table.py): the GPU's busy time is the union of the
kernels' intervals, so overlapping kernels count once and gaps not at all."""

from __future__ import annotations

from types import SimpleNamespace

from bench.kernel_table import busy_us


def kernel(start: float, end: float, device: str = "DeviceType.CUDA") -> SimpleNamespace:
    return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_busy_time_counts_overlaps_once_and_skips_gaps_and_host_events():
    events = [kernel(0, 10), kernel(5, 12), kernel(20, 30), kernel(22, 25), kernel(0, 100, "DeviceType.CPU")]
    assert busy_us(events) == (22.0, [])


def test_gaps_of_the_given_length_or_more_are_listed():
    events = [kernel(0, 10), kernel(15, 20), kernel(2000, 2010), kernel(5000, 5001)]
    assert busy_us(events, long_gap_us=1000.0) == (26.0, [(20.0, 1980.0), (2010.0, 2990.0)])


def test_no_kernels_is_no_busy_time():
    assert busy_us([kernel(0, 10, "DeviceType.CPU"), kernel(5, 5)]) == (0.0, [])
