"""The quantized kernels' config tables from a `bench gemms --quantization` report (the sweep's JSON).

`tables_from_sweep(report)` -> {(rows, N, K): config} of each cell's fastest config (LM heads left out:
they stay in the engine dtype unless the spec quantizes them). `python3 -m bench.quant_tables
sweep.json gate-up.json -- <bench arguments>` installs them into `skinny_gemm.TUNED_QUANTIZED` (an int8 sweep's:
`TUNED_INT8`) /
`gate_up.TUNED_GATE_UP_QUANTIZED` for this process and runs the benchmark, so that one device call can
sweep and then time the engines on what it found; the lines to paste into the tables are printed.
`python3 -m bench.quant_tables --fp8 fp8-sweep.json -- <bench arguments>` does the same with a
`bench fp8-gemms` report and `fp8_gemm.TUNED_FP8` (`fp8_sweep.table_of`; the entries it found replace
those of their shapes, the rest stay).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def tables_from_sweep(report: dict[str, Any], *, min_gain: float = 0.0) -> dict[tuple[int, int, int], str]:
    """Each cell's best config (gate/up cells: only where it beats the unfused path by `min_gain`)."""
    out = {}
    for cell in report["cells"]:
        best = cell["best"][0] if cell["best"] else None
        if best is None or cell["name"] == "lm_head":
            continue
        if min_gain and best["us"] >= (1 - min_gain) * cell["cublas_us"]:
            continue
        out[(cell["rows"], cell["n"], cell["k"])] = best["config"]
    return out


def install(skinny: dict[tuple[int, int, int], str], gate_up_table: dict[tuple[int, int, int], str], *,
            int8: bool = False) -> None:
    """The sweep's configs into the engine's tables for this process: an int8 sweep's GEMMs into `TUNED_INT8`."""
    from serving.engine import gate_up, skinny_gemm

    table, configs = ((skinny_gemm.TUNED_INT8, skinny_gemm.TUNED_INT8_CONFIGS) if int8
                      else (skinny_gemm.TUNED_QUANTIZED, skinny_gemm.TUNED_QUANTIZED_CONFIGS))
    table.update(skinny)
    configs.update(skinny_gemm.parse_table(skinny))
    gate_up.TUNED_GATE_UP_QUANTIZED.update(gate_up_table)
    gate_up.TUNED_GATE_UP_QUANTIZED_CONFIGS.update(skinny_gemm.parse_table(gate_up_table))


def install_fp8(report_path: str) -> None:
    from bench.fp8_sweep import table_of
    from serving.engine.fp8_gemm import TUNED_FP8, install_table

    table = table_of(json.loads(Path(report_path).read_text()))
    install_table({**TUNED_FP8, **table})  # shapes the sweep did not time keep their entries
    print("TUNED_FP8 |= {")
    for key, config in sorted(table.items()):
        print(f"    {key}: {config!r},")
    print("}", flush=True)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    if argv[0] == "--fp8":
        install_fp8(argv[1])
        from bench.__main__ import main as bench

        return bench(argv[split + 1:])
    from serving.engine.quantize import INT8_WEIGHT_ONLY

    sweep, gate = (json.loads(Path(p).read_text()) for p in argv[:split])
    skinny = tables_from_sweep(sweep)
    # one row: the w13 gemv and SiLU * up beat the fused kernel (8B: 35.5 + ~3 against 47.5 us, 2026-12-01)
    fused = {key: c for key, c in tables_from_sweep(gate, min_gain=0.02).items() if key[0] > 1}
    int8 = sweep.get("quantization") == INT8_WEIGHT_ONLY
    install(skinny, fused, int8=int8)
    for name, table in (("TUNED_INT8" if int8 else "TUNED_QUANTIZED", skinny), ("TUNED_GATE_UP_QUANTIZED", fused)):
        print(f"{name} += {{")
        for key, config in sorted(table.items()):
            print(f"    {key}: {config!r},")
        print("}", flush=True)
    from bench.__main__ import main as bench

    return bench(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
