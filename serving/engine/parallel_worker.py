"""A worker rank of a tensor-parallel engine: `python -m serving.engine.parallel_worker`, started by rank 0
(`parallel_workers.start_workers`), reading `parallel_protocol` messages on its stdin.

It loads its shard of the engine (`runner.load_model` with its `ParallelConfig`), builds the same
`EngineRunner` as rank 0 (the same KV-cache settings; the pool's size agreed in the group) and then runs each
step rank 0 sends, discarding the logits: rank 0 samples. It leaves at `Stop`, at the end of its pipe, or,
while it waits inside a collective, as soon as one of its lifelines is gone (`watch_lifelines`): its parent
(rank 0's process) and, where that is a Triton python-backend stub, the stub's parent, the server (a stub
outlives a SIGKILLed server until someone kills it). The PIDs are polled, with their start times against a
reused PID: Linux's PR_SET_PDEATHSIG would fire when the *thread* that started the worker ends (such as a
loader thread), not the process. A failure prints its traceback to stderr (rank 0's) and exits non-zero;
rank 0's next collective then fails and names this rank.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

import torch

from serving.engine.linears import apply_options
from serving.engine.options import resolve_options
from serving.engine.parallel import ParallelConfig
from serving.engine.parallel_group import Collectives, connect_store
from serving.engine.parallel_protocol import (
    AllLogits,
    Forward,
    ForwardAhead,
    Start,
    Stop,
    WarmUpDecode,
    read_message,
)
from serving.engine.parallel_workers import READY_KEY
from serving.engine.runner import EngineRunner, load_model

LIFELINE_POLL_S = 0.2
LIFELINE_GONE_EXIT = 3
TRITON_STUB_NAME = "triton_python_b"  # /proc/<pid>/comm of Triton's python stub (serving.triton.process's name)


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (state, ppid, ...), None once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _started(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None once it is gone or a zombie."""
    fields = _stat(pid)
    return None if fields is None or fields[0] in ("Z", "X") else fields[19]


def lifelines() -> dict[int, str | None]:
    """The processes whose end ends this worker, with their start times: its parent, and the parent's parent
    where the parent is a Triton python stub."""
    parent = os.getppid()
    pids = [parent]
    try:
        stub = Path(f"/proc/{parent}/comm").read_text().strip() == TRITON_STUB_NAME
    except OSError:
        stub = False
    if stub and (fields := _stat(parent)) is not None:
        pids.append(int(fields[1]))
    return {pid: _started(pid) for pid in pids}


def watch_lifelines(watched: dict[int, str | None]) -> None:
    """Exit the process (code LIFELINE_GONE_EXIT) as soon as a `watched` process is gone."""
    def watch() -> None:
        while all(_started(pid) == started for pid, started in watched.items()):
            time.sleep(LIFELINE_POLL_S)
        os._exit(LIFELINE_GONE_EXIT)

    threading.Thread(target=watch, name="enginewright-lifelines", daemon=True).start()


def start(message: Start) -> EngineRunner:
    """Join the group, load this rank's shard and its KV cache."""
    store = connect_store(message.store_port, message.size)
    store.set(READY_KEY.format(rank=message.rank), "1")
    device = torch.device(message.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = Collectives(store, message.rank, message.size, device)
    parallel = ParallelConfig(rank=message.rank, size=message.size, group=group)
    info, model, dev = load_model(message.engine_dir, device=message.device, parallel=parallel)
    apply_options(model, resolve_options(dev, info, message.overrides))
    return EngineRunner(info, model, dev, message.kv_cache, parallel=parallel)


def serve(runner: EngineRunner, pipe: BinaryIO) -> None:
    """Run each step rank 0 sends until `Stop` or the end of the pipe."""
    group = runner.parallel.group
    while True:
        message = read_message(pipe)
        if message is None or isinstance(message, Stop):
            return
        if isinstance(message, Forward):
            runner.forward(message.chunks, message.sample, every_token=message.every_token)
        elif isinstance(message, ForwardAhead):
            tokens = group.broadcast(torch.empty(message.tokens, dtype=torch.long, device=runner.device))
            runner.forward_ahead(message.chunks, tokens, message.rows)
        elif isinstance(message, AllLogits):
            runner.all_token_logits(message.chunks)
        elif isinstance(message, WarmUpDecode):
            runner.warm_up_decode()
        else:
            raise TypeError(f"unexpected message {type(message).__name__} after Start")


def main() -> None:
    watch_lifelines(lifelines())
    pipe = sys.stdin.buffer
    first = read_message(pipe)
    if not isinstance(first, Start):
        raise SystemExit(f"parallel_worker: expected a Start message first, got {type(first).__name__}")
    runner = start(first)
    serve(runner, pipe)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no process-group teardown: rank 0 may be gone already


if __name__ == "__main__":
    main()
