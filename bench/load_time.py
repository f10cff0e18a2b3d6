"""Load time: an engine's first load on a machine (Triton compiling its kernels) against a second one (Triton's
kernel cache on disk from the first).

`measure_load` (one process, `python3 -m bench engine-load`) loads an engine folder the way the decoupled
`llm` model does (`load_engine`, then `EngineThread`: the cold prompt steps, a mixed step and every decode graph
captured) and times the load, the time to ready, and one generate after it. `run_load_pair` runs it twice,
each in a fresh process sharing one Triton cache folder that starts empty, so that the first load compiles
every kernel and the second finds them compiled. `run_triton_loads` does the same with two Triton servers.
(The compile cache of earlier releases went with the static engine's compiled decode step.)

Imports: stdlib at import time; torch and serving.engine inside the functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]  # `python -m bench` runs from the repository


def fresh_triton_cache(parent: Path) -> dict[str, str]:
    """The environment variable pointing Triton's kernel cache at a new empty folder under `parent`."""
    return {"TRITON_CACHE_DIR": str(Path(tempfile.mkdtemp(prefix="triton-cache-", dir=parent)))}


def triton_folders(triton_dir: Path) -> dict[str, Any]:
    """The Triton cache folders after a load (one per compiled kernel variant) and the kernels' names."""
    folders = sorted(d for d in triton_dir.iterdir() if d.is_dir()) if triton_dir.is_dir() else []
    kernels = sorted({f.name.split(".")[0] for d in folders for f in d.iterdir()
                      if f.suffix == ".json" and not f.name.startswith("__grp__")})
    return {"folders": len(folders), "kernels": kernels}


def measure_load(engine_dir: Path, *, batch: int = 8, gen_len: int = 16, profile: Path | None = None
                 ) -> dict[str, Any]:
    """Load and warm up (`EngineThread`), then time one generate; with the breakdown: torch import, CUDA start,
    kernel imports, weights, the decode graphs' captures. With `profile`, the warm-up runs on this thread under
    cProfile instead of the engine thread, and the 60 most expensive calls (cumulative) are written there."""
    t_import = time.perf_counter()
    import torch

    from serving.engine import load_engine
    from serving.triton.models.llm import EngineThread, Log

    lines: list[str] = []

    class _Log(Log):
        def info(self, msg: str) -> None:
            lines.append(msg)
            super().info(msg)

    log = _Log("load-bench")
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
    cuda_started = time.perf_counter()
    import_kernels()
    kernels_imported = time.perf_counter()
    runner = load_engine(engine_dir, device="auto")
    if cuda:
        torch.cuda.synchronize()
    loaded = time.perf_counter()
    thread = EngineThread(runner, log, device_id=0 if cuda else None, warmup=True)
    if profile is None:
        thread.start()
    else:
        _profiled(profile, runner.warm_up_prefill)
    ready = time.perf_counter()
    if profile is None:
        thread.stop()
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(64)] for i in range(batch)]
    g0 = time.perf_counter()
    runner.generate(prompts, max_new_tokens=gen_len, logprobs=False)
    if cuda:
        torch.cuda.synchronize()
    generated = time.perf_counter()
    return {
        "engine": str(engine_dir), "load_s": loaded - t0, "prepare_s": ready - loaded, "ready_s": ready - t0,
        "breakdown": {"import_s": t0 - t_import, "cuda_start_s": cuda_started - t0,
                      "kernel_imports_s": kernels_imported - cuda_started, "weights_s": loaded - kernels_imported,
                      "captures_s": round(runner.decode.capture_s, 3), "profiled": str(profile) if profile else None},
        "first_generate_s": generated - g0, "graphs": len(runner.decode.graphs), "log": lines,
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
        "triton_folders": triton_folders(Path(os.environ["TRITON_CACHE_DIR"]))
        if os.environ.get("TRITON_CACHE_DIR") else None,
    }


def import_kernels() -> None:
    """What an engine's load imports besides torch: Triton and the engine's kernel modules."""
    import serving.engine.cuda_graphs
    import serving.engine.gate_up
    import serving.engine.paged_attention
    import serving.engine.skinny_gemm  # noqa: F401


def _profiled(out: Path, work: Any) -> None:
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(work)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
    out.write_text(text.getvalue())


def run_load_pair(engine_dir: Path, work: Path, *, timeout_s: float = 300.0, profile: bool = False
                  ) -> dict[str, Any]:
    """First load (an empty Triton cache folder) then second load (the first's compiled kernels), each in a
    fresh process; with `profile`, a third ("second-profiled", as the second under cProfile:
    `<work>/second-profile.txt`)."""
    report: dict[str, Any] = {}
    env = {**os.environ, **fresh_triton_cache(work), "PYTHONUNBUFFERED": "1"}
    for label in ("first", "second", "second-profiled") if profile else ("first", "second"):
        out = work / f"load-{label}.json"
        started = time.perf_counter()
        cmd = [sys.executable, "-m", "bench", "engine-load", "--engine", str(engine_dir), "--out", str(out)]
        if label == "second-profiled":
            cmd += ["--profile", str(work / "second-profile.txt")]
        done = subprocess.run(cmd, check=False, env=env, timeout=timeout_s, cwd=REPO)  # its output: this process's
        if done.returncode != 0:
            report[label] = {"error": f"rc={done.returncode}"}
            break
        report[label] = json.loads(out.read_text())
        report[label]["process_s"] = time.perf_counter() - started
        print(label, {k: v for k, v in report[label].items() if k != "log"}, flush=True)
    return report


MODEL = "loadbench"


def run_triton_loads(engine_dir: Path, work: Path, *, load_timeout_s: float = 300.0,
                     during_second: Any = None) -> dict[str, Any]:
    """The engine staged as a decoupled `llm` model, loaded by two Triton servers one after the other, sharing
    one Triton cache folder that starts empty: the first load compiles the kernels, the second finds them.
    Each: model load to ready (`load_model` returning), then one request through `/generate`. `during_second(metrics_url, http_url)`, when given, runs while the second
    server serves the engine; what it returns is reported under ``during_second``."""
    from serving.triton import init_repository, stage_engine_version
    from serving.triton.client import generate_ids
    from serving.triton.process import start_triton

    root = init_repository(work / "repo")
    version = stage_engine_version(root, MODEL, engine_dir, device_kind="auto", parameters={"decoupled": "true"})
    model = f"{MODEL}_v{version}"
    report: dict[str, Any] = {}
    dirs = fresh_triton_cache(work)
    os.environ.update(dirs)  # the stub inherits tritonserver's environment
    for label in ("first", "second"):
        log_path = work / f"triton-{label}.log"
        proc = start_triton(root, log_path=log_path, ready_timeout_s=120)
        figures: dict[str, Any] = {}
        report[label] = figures
        try:
            started = time.perf_counter()
            proc.control().load_model(model, timeout_s=load_timeout_s)
            figures["load_s"] = time.perf_counter() - started
            started = time.perf_counter()
            out = generate_ids(proc.http_url, model, list(range(1, 65)), max_tokens=16)
            figures["first_request_s"] = time.perf_counter() - started
            figures["tokens"] = len(out.output_ids)
            if label == "second" and during_second is not None:
                try:
                    figures["during_second"] = during_second(proc.metrics_url, proc.http_url)
                except Exception as exc:  # noqa: BLE001 - reported; the load figures stand
                    figures["during_second"] = {"error": f"{type(exc).__name__}: {exc}"}
                out = generate_ids(proc.http_url, model, list(range(1, 65)), max_tokens=16)
                figures["tokens_after"] = len(out.output_ids)  # the live engine still serves
        finally:
            proc.stop(timeout_s=20)
        figures["triton_folders"] = triton_folders(Path(dirs["TRITON_CACHE_DIR"]))
        text = log_path.read_text(errors="replace")
        figures["log"] = [line[-600:] for line in text.splitlines()
                          if "ready in" in line
                          or "loaded from" in line or "captured" in line]
        print(label, {k: v for k, v in figures.items() if k != "log"}, flush=True)
    return report
