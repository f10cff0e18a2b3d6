"""The quantized kernels' config tables from a `bench gemms --quantization` report (the sweep's JSON).

`tables_from_sweep(report)` -> {(rows, N, K): config} of each cell's fastest config (LM heads left out:
they stay in the engine dtype unless the spec quantizes them). `python3 -m bench.quant_tables
sweep.json gate-up.json -- <bench arguments>` writes them into the current GPU's tuned kernel file
(`serving/engine/tuned/<device>.json`, sections `skinny_fp8` (an int8 sweep's: `skinny_int8`) and
`gate_up_quantized`; `tuned_tables.write_table`) and runs the benchmark, whose engines read that file at load,
so that one device call can sweep and then time the engines on what it found; bring the file back with the
results. `python3 -m bench.quant_tables --fp8 fp8-sweep.json -- <bench arguments>` does the same with a
`bench fp8-gemms` report and the `fp8` section (`fp8_sweep.table_of`; the entries it found replace those of
their shapes, the rest stay).
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


def current_device() -> tuple[str, str]:
    """(CUDA device name, compute capability "9.0") of the current GPU: whose tuned file a sweep writes."""
    import torch

    return torch.cuda.get_device_name(), "{}.{}".format(*torch.cuda.get_device_capability())


def install(skinny: dict[tuple[int, int, int], str], gate_up_table: dict[tuple[int, int, int], str], *,
            int8: bool = False, device: tuple[str, str] | None = None, directory: Path | None = None) -> Path:
    """The sweep's configs into the device's tuned file: an int8 sweep's GEMMs into `skinny_int8`."""
    from serving.engine.tuned_tables import TUNED_DIR, write_table

    name, capability = device or current_device()
    where = directory or TUNED_DIR
    write_table(name, capability, "skinny_int8" if int8 else "skinny_fp8", skinny, directory=where)
    return write_table(name, capability, "gate_up_quantized", gate_up_table, directory=where)


def install_fp8(report_path: str, *, device: tuple[str, str] | None = None, directory: Path | None = None) -> Path:
    """A `bench fp8-gemms` report's table into the device's tuned file (`fp8`; shapes the sweep did not time
    keep their entries)."""
    from bench.fp8_sweep import table_of
    from serving.engine.tuned_tables import TUNED_DIR, write_table

    name, capability = device or current_device()
    path = write_table(name, capability, "fp8", table_of(json.loads(Path(report_path).read_text())),
                       directory=directory or TUNED_DIR)
    print(f"tuned fp8 configs written to {path}", flush=True)
    return path


def main(argv: list[str]) -> int:
    split = argv.index("--")
    if argv[0] == "--fp8":
        install_fp8(argv[1])
        from bench.__main__ import main as bench

        return bench(argv[split + 1:])
    from serving.engine.quantize import INT8_WEIGHT_ONLY

    sweep, gate = (json.loads(Path(p).read_text()) for p in argv[:split])
    skinny = tables_from_sweep(sweep)
    # one row: the w13 gemv and SiLU * up beat the fused kernel (docs/quantization.md)
    fused = {key: c for key, c in tables_from_sweep(gate, min_gain=0.02).items() if key[0] > 1}
    int8 = sweep.get("quantization") == INT8_WEIGHT_ONLY
    print(f"tuned quantized configs written to {install(skinny, fused, int8=int8)}", flush=True)
    from bench.__main__ import main as bench

    return bench(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
