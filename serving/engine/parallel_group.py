"""The collectives of one tensor-parallel group: `torch.distributed` process groups made directly from a
`TCPStore` on loopback (gloo on the CPU, NCCL on CUDA), not through `init_process_group`, so that one process
may hold several engines of several groups (the release gates load the candidate and production side by side).

Rank 0 (the engine's own process) opens the store on a free port (`open_store`); the worker ranks connect to
it (`connect_store`). `Collectives` is what the layers call (`all_reduce`, `all_gather`) and what the step
protocol uses besides the pipe (`broadcast` of the previous step's sampled tokens, `min_int` of the pool
sizes at start).

A dead peer fails a gloo collective at once ("Connection closed by peer"); NCCL would wait for its timeout,
so rank 0 also watches its workers' processes (`parallel_workers.Workers.check_alive`) before each step and
aborts the NCCL group when one is gone (`abort`).

Imports: stdlib and torch only.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT_S = 300.0  # a collective that waits longer fails (a rank stuck, not dead)


def open_store(size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`store.port`)."""
    return dist.TCPStore(LOOPBACK, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def connect_store(port: int, size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """A worker rank's connection to rank 0's store."""
    return dist.TCPStore(LOOPBACK, port, size, False, timeout=datetime.timedelta(seconds=timeout_s))


class Collectives:
    """One process group's collectives over tensors of `device` (gloo for the CPU, NCCL for CUDA)."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.rank, self.size, self.device = rank, size, device
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":  # written against torch's ProcessGroupNCCL API; run on GPUs only
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group: dist.ProcessGroup = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size,
                                                                  options)
        else:
            self.group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of x, in place; returns x."""
        self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [N, M] (2-D) side by side -> [N, size * M] (rank r's in columns r*M..(r+1)*M)."""
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self.group._allgather_base(out, x.contiguous()).wait()
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype), in place; returns x."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([x], options).wait()
        return x

    def min_int(self, value: int) -> int:
        """The least of every rank's `value`."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], options).wait()
        return int(t.item())

    def abort(self) -> None:
        """Stop waiting on peers that are gone (NCCL's communicators aborted; gloo fails on its own)."""
        if self.device.type == "cuda":
            self.group.abort()
