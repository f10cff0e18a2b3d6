"""Load time: an engine's first load (compiling its decode step) against a second one (restoring the compile cache).

`measure_load` (one process, `python3 -m bench engine-load`) loads an engine folder the way the
decoupled `llm` model does (`load_engine`, then `EngineThread`: compiled decode step, every graph captured,
the cold prefills run, with `serving.engine.compile_cache` restored first or stored after) and times the
load, the time to ready, and one generate after it. `run_load_pair` runs it twice, each in a fresh process
with fresh empty inductor and Triton cache folders, so that the second load finds nothing but the
compile cache of the first. Figures in docs/performance.md.

Imports: stdlib at import time; torch and serving.engine inside the functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]  # `python -m bench` runs from the repository


def fresh_compile_dirs(parent: Path) -> dict[str, str]:
    """Environment variables pointing inductor's and Triton's caches at new empty folders under `parent` (new
    names each time: the compile cache must not depend on where the folders were when it was stored)."""
    base = Path(tempfile.mkdtemp(prefix="compile-dirs-", dir=parent))
    return {"TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"), "TRITON_CACHE_DIR": str(base / "triton")}


def triton_folders(triton_dir: Path, cache_root: Path | None) -> dict[str, Any]:
    """The Triton cache folders after a load: how many came from the compile cache's archives under `cache_root`
    and which kernels (the names of their files) Triton compiled here instead."""
    restored: set[str] = set()
    for archive in sorted(cache_root.glob("*/*/triton.tar.gz")) if cache_root is not None else ():
        with tarfile.open(archive, "r:gz") as tar:
            restored |= {Path(m.name).parts[0] for m in tar.getmembers()}
    folders = sorted(d for d in triton_dir.iterdir() if d.is_dir()) if triton_dir.is_dir() else []
    compiled = [d for d in folders if d.name not in restored]
    kernels = sorted({f.name.split(".")[0] for d in compiled for f in d.iterdir()
                      if f.suffix == ".json" and not f.name.startswith("__grp__")})
    return {"folders": len(folders), "from_archive": len(folders) - len(compiled), "compiled_here": len(compiled),
            "compiled_kernels": kernels}


def measure_load(engine_dir: Path, cache_root: Path | None, *, batch: int = 8, gen_len: int = 16,
                 profile: Path | None = None) -> dict[str, Any]:
    """Load, compile (with the compile cache under `cache_root`), warm up, then time one generate; with the
    breakdown: torch import, CUDA start, weights, each graph's capture (its compile included), torch's compile
    caches (`compile_trace`). With `profile`, the compile and warm-up run on this thread under cProfile instead
    of the engine thread, and the 60 most expensive calls (cumulative) are written there."""
    t_import = time.perf_counter()
    import torch
    from serving.engine.compile_cache import decode_step_cache, inductor_cache_counts

    from bench.compile_trace import CompileTrace
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
    thread = EngineThread(runner, log, device_id=0 if cuda else None, compile_decode=True, warmup=True,
                          compile_cache_root=cache_root)
    with CompileTrace() as trace:
        if profile is None:
            thread.start()
        else:
            _profiled(profile, lambda: (thread.prepare_decode(), runner.warm_up_prefill()))
    ready = time.perf_counter()
    if profile is None:
        thread.stop()
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(64)] for i in range(batch)]
    g0 = time.perf_counter()
    runner.generate(prompts, max_new_tokens=gen_len, logprobs=False)
    if cuda:
        torch.cuda.synchronize()
    generated = time.perf_counter()
    cache = decode_step_cache(runner, cache_root, pdl=thread.decode_pdl)
    graphs = runner.graphs
    return {
        "engine": str(engine_dir), "load_s": loaded - t0, "prepare_s": ready - loaded, "ready_s": ready - t0,
        "breakdown": {"import_s": t0 - t_import, "cuda_start_s": cuda_started - t0,
                      "kernel_imports_s": kernels_imported - cuda_started, "weights_s": loaded - kernels_imported,
                      "captures_s": {f"{b}x{kv}": round(s, 3) for (b, kv), s in
                                     (graphs.capture_times.items() if graphs is not None else ())},
                      "profiled": str(profile) if profile else None},
        "first_generate_s": generated - g0, "compile_decode": thread.compile_decode, "decode_pdl": thread.decode_pdl,
        "graphs": len(graphs.graphs) if graphs is not None else 0,
        "fx_graph_cache": inductor_cache_counts(), "cache_entry": str(cache.entry) if cache else None,
        "restored": any("restored" in line for line in lines), "log": lines,
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
        "compile_trace": trace.report(),
        "triton_folders": triton_folders(Path(os.environ["TRITON_CACHE_DIR"]), cache_root)
        if os.environ.get("TRITON_CACHE_DIR") else None,
    }


def import_kernels() -> None:
    """What an engine's load imports besides torch: Triton, inductor's runtime and the engine's kernel modules."""
    import serving.engine.decode_attention

    import serving.engine.cuda_graphs
    import serving.engine.gate_up
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


def run_load_pair(engine_dir: Path, cache_root: Path, work: Path, *, timeout_s: float = 300.0,
                  profile: bool = False) -> dict[str, Any]:
    """First load (empty compile cache) then second load (the first's cache), each in a fresh process with
    fresh inductor/Triton cache folders; with `profile`, a third ("second-profiled", as the second under
    cProfile: `<work>/second-profile.txt`). ``aot_key_differences``: why the second's AOTAutograd lookups that
    missed did (`compile_trace.key_differences`)."""
    from bench.compile_trace import key_differences

    report: dict[str, Any] = {}
    for label in ("first", "second", "second-profiled") if profile else ("first", "second"):
        out = work / f"load-{label}.json"
        env = {**os.environ, **fresh_compile_dirs(work), "PYTHONUNBUFFERED": "1"}
        started = time.perf_counter()
        cmd = [sys.executable, "-m", "bench", "engine-load", "--engine", str(engine_dir),
               "--compile-cache", str(cache_root), "--out", str(out)]
        if label == "second-profiled":
            cmd += ["--profile", str(work / "second-profile.txt")]
        done = subprocess.run(cmd, check=False, env=env, timeout=timeout_s, cwd=REPO)  # its output: this process's
        if done.returncode != 0:
            report[label] = {"error": f"rc={done.returncode}"}
            break
        report[label] = json.loads(out.read_text())
        report[label]["process_s"] = time.perf_counter() - started
        print(label, {k: v for k, v in report[label].items() if k not in ("log", "compile_trace")}, flush=True)
    if "compile_trace" in report.get("second", {}):
        report["aot_key_differences"] = key_differences(report["first"]["compile_trace"]["aot_keys"],
                                                        report["second"]["compile_trace"]["aot_keys"])
        print("AOTAutograd keys of the second load that the first lacked:",
              json.dumps(report["aot_key_differences"], indent=1)[:20000], flush=True)
    return report


MODEL = "loadbench"


def run_triton_loads(engine_dir: Path, work: Path, *, load_timeout_s: float = 300.0,
                     during_second: Any = None) -> dict[str, Any]:
    """The engine staged as a decoupled, compiled `llm` model, loaded by two Triton servers one after the
    other, each with fresh inductor/Triton cache folders and the same `compile_cache_dir`: the first load
    compiles and stores, the second restores. Each: model load to ready (`load_model` returning), then one
    request through `/generate`. `during_second(metrics_url, http_url)`, when given, runs while the second
    server serves the engine; what it returns is reported under ``during_second``."""
    from serving.triton import init_repository, stage_engine_version
    from serving.triton.client import generate_ids
    from serving.triton.process import start_triton

    root = init_repository(work / "repo")
    cache_dir = work / "triton-compile-cache"
    version = stage_engine_version(root, MODEL, engine_dir, device_kind="auto", parameters={
        "decoupled": "true", "compile_decode": "true", "compile_cache_dir": str(cache_dir)})
    model = f"{MODEL}_v{version}"
    report: dict[str, Any] = {}
    for label in ("first", "second"):
        dirs = fresh_compile_dirs(work)
        os.environ.update(dirs)  # the stub inherits tritonserver's environment
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
        figures["triton_folders"] = triton_folders(Path(dirs["TRITON_CACHE_DIR"]), cache_dir)
        text = log_path.read_text(errors="replace")
        figures["log"] = [line[-600:] for line in text.splitlines()
                          if "compile cache" in line or "compiled in" in line or "ready in" in line
                          or "loaded from" in line or "captured" in line]
        print(label, {k: v for k, v in figures.items() if k != "log"}, flush=True)
    return report
