"""What each Triton compile's cache key is made of, logged per process: why a kernel put back from the compile
cache is compiled again (`device_load_time.sh` with KEYS=1; `report` compares the first load's against the
second's).

`install()` wraps Triton's `get_cache_key` (the key of a compile: Triton's own version, the kernel's source hash
with its specialisation, the backend, the options, the cache-invalidating environment) and appends each part,
per kernel, to `<dir>/<pid>.jsonl`. A .pth line in the Triton stub's venv calls it in every process that starts
with TRITON_KEY_LOG set (the stub ignores PYTHONPATH).

Imports: stdlib; Triton when installed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

ENV = "TRITON_KEY_LOG"


def _parts(src: Any, backend: Any, options: Any, env_vars: dict[str, str]) -> dict[str, Any]:
    from triton.runtime.cache import triton_key

    out: dict[str, Any] = {"pid": os.getpid(), "triton": triton_key()[:12], "backend": backend.hash(),
                           "options": str(sorted(options.__dict__.items())), "env": str(sorted(env_vars.items()))}
    fn = getattr(src, "fn", None)
    if fn is not None:
        constants = sorted((str(k), getattr(v, "cache_key", str(v))) for k, v in src.constants.items())
        out.update(name=fn.__name__, source=fn.cache_key[:12], line=fn.starting_line_number,
                   attrs=str(src.attrs), signature=str(sorted(src.signature.items())), constants=str(constants),
                   globals=str(sorted((name, repr(val)[:80]) for (name, _), (val, _) in fn.used_global_vals.items())))
    return out


def install(log_dir: Path) -> None:
    from triton.compiler import compiler
    from triton.runtime import jit

    original = compiler.get_cache_key

    def logged(src: Any, backend: Any, options: Any, env_vars: dict[str, str]) -> str:
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(_parts(src, backend, options, env_vars)) + "\n")
        return original(src, backend, options, env_vars)

    compiler.get_cache_key = jit.get_cache_key = logged


def report(log_dir: Path) -> list[str]:
    """Per kernel compiled in more than one process: the parts of the key that differ between the first
    process's compile and the last one's of the same specialisation (nearest by parts), or that none do."""
    by_kernel: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for path in sorted(log_dir.glob("*.jsonl"), key=lambda p: p.stat().st_mtime):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            by_kernel.setdefault(rec.get("name", "?"), {}).setdefault(rec["pid"], []).append(rec)
    lines = []
    for name, per_pid in sorted(by_kernel.items()):
        if len(per_pid) < 2:
            continue
        processes = list(per_pid.values())
        first, last = processes[0], processes[-1]
        rec = last[0]
        nearest = min(first, key=lambda r: sum(r.get(k) != rec.get(k) for k in rec if k != "pid"))
        differ = {k: (str(nearest.get(k))[:160], str(rec.get(k))[:160]) for k in rec
                  if k != "pid" and nearest.get(k) != rec.get(k)}
        lines.append(f"{name}: {len(first)} / {len(last)} compiles; differ: {differ or 'nothing'}")
    return lines


if __name__ == "__main__":
    print("\n".join(report(Path(sys.argv[1]))))
