"""bench/ab_cells.py (behind bench/device_previous_vs_current.sh): each tree's settings of a cell and the table of
the reports. The drive itself needs the previous tree (.ab/old, not in a clone): its CPU run is in the script's
header."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.ab_cells import cell_configs, render_table
from bench.throughput import ThroughputConfig


def test_a_cell_sets_the_static_engine_beside_the_paged_one_and_the_current_engine_at_the_same_requests():
    big = cell_configs(1024, shape="tiny", workload=(128, 128), quantization="fp8", fraction=0.85, old_fraction=0.6)
    assert (big["old"]["free_mem_fraction"], big["new"]["free_mem_fraction"]) == (0.6, 0.85)
    assert big["old"]["sides"] == ["static", "paged"] and big["new"]["sides"] == ["engine"]
    assert (big["old"]["static_batch"], big["old"]["paged_live"], big["new"]["max_live"]) == (512, 1024, 1024)
    assert big["old"]["max_num_tokens"] == big["new"]["max_num_tokens"] == 16384
    assert big["old"]["warmup_requests"] == big["new"]["warmup_requests"] == 128
    one = cell_configs(1, shape="tiny", workload=(16, 8), quantization="none", fraction=0.85, old_fraction=0.6,
                       num_blocks=64)
    assert (one["old"]["static_batch"], one["new"]["max_live"], one["new"]["warmup_requests"]) == (1, 1, 1)
    config = ThroughputConfig(**{**one["new"], "sides": tuple(one["new"]["sides"])})  # every field is the bench's
    assert config.num_blocks == 64 and config.input_len == 16 and config.quantization == "none"


def test_the_table_sets_the_new_engine_against_both_old_sides_and_marks_what_is_missing(tmp_path: Path):
    def report(path: str, **sides: tuple[float, float]) -> None:
        (tmp_path / path).write_text(json.dumps({"config": {}, "sides": [
            {"side": side, "output_tok_s": tok_s, "tpot_ms": {"p50": tpot}} for side, (tok_s, tpot) in sides.items()]}))

    report("old-none-t64.json", static=(1000.0, 10.0), paged=(800.0, 12.0))
    report("new-none-t64.json", engine=(1200.0, 8.0))
    report("old-fp8-t1.json", static=(50.0, 20.0), paged=(40.0, 25.0))  # its new side failed: no report
    lines = render_table(tmp_path).splitlines()
    assert lines[0].split()[:2] == ["cell", "metric"]
    bf16 = next(line for line in lines if line.startswith("bf16 x64") and "tok/s" in line).split()
    assert bf16[-5:] == ["1000.0", "800.0", "1200.0", "1.200", "1.500"]
    tpot = next(line for line in lines if line.startswith("bf16 x64") and "TPOT" in line).split()
    assert [float(x) for x in tpot[-2:]] == pytest.approx([0.8, 0.667])
    fp8 = next(line for line in lines if line.startswith("fp8 x1") and "tok/s" in line).split()
    assert fp8[-3:] == ["-", "-", "-"]
    assert [line.split()[0] for line in lines[2:]] == ["bf16", "bf16", "fp8", "fp8"]  # bf16 first
