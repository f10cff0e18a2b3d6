"""Rank 0's side of a tensor-parallel engine: it starts the worker ranks as processes of its own, meets them in
one process group, sends them each step (`parallel_protocol`) and stops them with itself.

`start_workers(info, device, overrides, kv_cache)` (called by `runner.load_engine` for an engine built with
`tensor_parallel` > 1): opens the group's store on a free loopback port, starts ranks 1..size-1 as
`python -m serving.engine.parallel_worker` (each its `Start` message on its stdin pipe, its device the next GPU
after rank 0's: rank r on cuda:(i + r); every rank on the CPU), waits for them to reach the store (a worker
that dies first is reported with its exit code, not waited for), and joins the group. The returned `Workers`
holds rank 0's `ParallelConfig` for its model.

A worker never outlives rank 0: its main loop ends at the end of its pipe, and a watchdog thread ends it when
its parent process is gone while it waits inside a collective (`parallel_worker`). Rank 0's `Workers.stop`
(`EngineRunner.close`, the Triton model's unload) sends `Stop`, then kills a worker that has not left within
`STOP_WAIT_S`, by its PID.

A worker that dies while serving fails the step that needed it with `WorkerRankError` naming its rank, PID and
exit code (gloo notices the closed connection at once; on CUDA the NCCL communicators are aborted), and every
later step fails the same way at once: the engine cannot compute without that rank, so its version is to be
rolled back or reloaded. A step that fails on rank 0 itself leaves the ranks out of step: the workers are
stopped and later steps refused, naming the first failure.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from serving.engine.errors import EngineError, EngineLimitError
from serving.engine.parallel import ParallelConfig
from serving.engine.parallel_group import Collectives, open_store
from serving.engine.parallel_protocol import Message, Start, Stop, write_message

STOP_WAIT_S = 5.0  # how long a stopped worker may take to leave before it is killed
READY_KEY = "ready/{rank}"  # set in the store by each worker once it runs (before the group's rendezvous)
START_TIMEOUT_S = 120.0  # a worker that has not reached the store by then is killed and the load fails
WORKER_MODULE = "serving.engine.parallel_worker"


class WorkerRankError(EngineError):
    """A worker rank of a tensor-parallel engine is gone, or the ranks are out of step."""


def worker_device(device: torch.device, rank: int, size: int) -> str:
    """Rank `rank`'s device: the CPU, or the `rank`-th GPU after rank 0's."""
    if device.type != "cuda":
        return "cpu"
    first = device.index if device.index is not None else torch.cuda.current_device()
    if first + size > torch.cuda.device_count():
        raise EngineLimitError(f"tensor_parallel={size} needs GPUs cuda:{first}..cuda:{first + size - 1} (rank 0 on "
                               f"cuda:{first}); this host has {torch.cuda.device_count()}")
    return f"cuda:{first + rank}"


def python_executable() -> str:
    """The interpreter to start workers with (inside Triton's python backend stub, sys.executable is the stub's
    own path: the venv's `python3` on PATH instead)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    found = shutil.which("python3")
    if found is None:
        raise WorkerRankError(f"cannot start tensor-parallel workers: sys.executable={sys.executable!r} is not a "
                              "python interpreter and no python3 is on PATH")
    return found


def _worker_env() -> dict[str, str]:
    """This environment with the folder holding the `serving` package first on PYTHONPATH."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


class Workers:
    """Rank 0's handle on its worker ranks: their processes, the group, the step messages."""

    def __init__(self, procs: list[subprocess.Popen], parallel: ParallelConfig) -> None:
        self.procs, self.parallel = procs, parallel
        self.broken: str | None = None  # why no step may run any more
        self._stopper = weakref.finalize(self, _stop_processes, list(procs))  # at exit, if nobody stopped them

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check_alive(self) -> None:
        """Raise WorkerRankError naming the first worker rank that has exited (remembered: the first reason
        stands), or why the ranks stopped earlier."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None and self.broken is None:
                self.broken = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}: this "
                               "engine cannot compute without it; roll its version back or reload it")
        if self.broken is not None:
            raise WorkerRankError(self.broken)

    @contextlib.contextmanager
    def step(self, message: Message) -> Iterator[None]:
        """Send `message` to every worker, then run rank 0's part of it (the body); a failure either side is
        a WorkerRankError (module doc)."""
        self.check_alive()
        try:
            for proc in self.procs:
                write_message(proc.stdin, message)
            yield
        except Exception as exc:
            for proc in self.procs:  # a peer's death shows in rank 0's collective before its exit code does
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1.0)
            self.check_alive()
            self.broken = (f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc}); the ranks are "
                           "out of step and the workers were stopped: reload the engine")
            self.stop()
            raise WorkerRankError(self.broken) from exc

    def stop(self) -> None:
        """Stop every worker (Stop, then kill after STOP_WAIT_S) and abort the group's pending collectives."""
        if self.parallel.group is not None and any(p.poll() is None for p in self.procs):
            for proc in self.procs:
                with contextlib.suppress(OSError, ValueError):
                    write_message(proc.stdin, Stop())
        _stop_processes(self.procs)
        if self.broken is not None and self.parallel.group is not None:
            self.parallel.group.abort()
        self._stopper.detach()


def _stop_processes(procs: list[subprocess.Popen]) -> None:
    """Close each worker's pipe (its loop ends there), wait STOP_WAIT_S, then kill it by PID."""
    for proc in procs:
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.close()
    deadline = time.monotonic() + STOP_WAIT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_workers(engine_dir: Path, size: int, device: torch.device, *, overrides: Mapping[str, Any] | None,
                  kv_cache: Any) -> Workers:
    """Start ranks 1..size-1 of the engine in `engine_dir` and join their group as rank 0 (module doc)."""
    store = open_store(size)
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(1, size):
            proc = subprocess.Popen([python_executable(), "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                                    env=_worker_env())
            procs.append(proc)
            write_message(proc.stdin, Start(engine_dir=str(engine_dir), rank=rank, size=size, store_port=store.port,
                                            device=worker_device(device, rank, size),
                                            overrides=dict(overrides or {}), kv_cache=kv_cache))
        _wait_ready(store, procs)
        group = Collectives(store, 0, size, device)
    except BaseException:
        _stop_processes(procs)
        raise
    return Workers(procs, ParallelConfig(rank=0, size=size, group=group))


def _wait_ready(store: Any, procs: list[subprocess.Popen]) -> None:
    """Until every worker has set its READY_KEY; a worker that exits first fails the start, naming it."""
    keys = [READY_KEY.format(rank=rank) for rank in range(1, len(procs) + 1)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not store.check(keys):
        for rank, proc in enumerate(procs, start=1):
            if proc.poll() is not None:
                raise WorkerRankError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                                      f"{proc.returncode} while starting (its stderr is this process's)")
        if time.monotonic() > deadline:
            raise WorkerRankError(f"tensor-parallel workers {keys} did not start within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.02)
