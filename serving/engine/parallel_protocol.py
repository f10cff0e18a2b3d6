"""The step protocol between rank 0 of a tensor-parallel engine and its worker ranks.

Rank 0 runs the scheduler, the KV cache's block allocator and the sampler; a worker rank holds only its shard
of the weights and of the KV cache and runs, for each message, the same `EngineRunner` computation rank 0 runs
(the collectives inside the layers keep them in step). The messages say which computation and its inputs, the
block tables included (the same block ids on every rank); nothing comes back but the collectives:

- `Start`: the first message, what the worker loads and how (engine folder, device, options, KV-cache settings)
  and where the group meets (rank 0's store port);
- `Forward`: `EngineRunner.forward(chunks, sample, every_token)`, a mixed or decode-only step;
- `ForwardAhead`: `EngineRunner.forward_ahead`: a decode step whose input tokens rank 0 sampled on the device
  and never read on the host; they follow the message as a broadcast of `tokens` int64 values;
- `AllLogits`: `EngineRunner.all_token_logits(chunks)`, a teacher-forced step (`prefill_logits`);
- `WarmUpDecode`: capture the decode graphs (CUDA; both ranks capture the same collectives);
- `Stop`: leave the loop (so does the end of the pipe: rank 0 gone).

Sampling happens on rank 0 alone, from the whole logits the LM head all-gathers; the sampled tokens reach the
workers as the next step's inputs (in the message, or broadcast for `ForwardAhead`). One sampler means no
seeded generator has to stay in step on every rank, and the workers never touch the scheduler's state.

Wire format: each message pickled, behind its length (4 bytes, big-endian), on the worker's stdin pipe.

Imports: stdlib only.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

ChunkPlan = tuple[list[int], int, list[int]]  # as step.ChunkPlan: (tokens, start position, block table)
_LENGTH = struct.Struct(">I")


@dataclass(frozen=True)
class Start:
    engine_dir: str
    rank: int
    size: int
    store_port: int
    device: str  # this worker's, e.g. "cpu" or "cuda:1"
    overrides: dict[str, Any]  # EngineOptions fields set for the load, as rank 0's
    kv_cache: Any  # kv_cache.KVCacheConfig: rank 0's, after its overrides (the pool size is agreed at start)


@dataclass(frozen=True)
class Forward:
    chunks: list[ChunkPlan]
    sample: list[int]
    every_token: list[int]


@dataclass(frozen=True)
class ForwardAhead:
    chunks: list[ChunkPlan]
    rows: list[int]
    tokens: int  # how many int64 tokens rank 0 broadcasts after this message


@dataclass(frozen=True)
class AllLogits:
    chunks: list[ChunkPlan]


@dataclass(frozen=True)
class WarmUpDecode:
    pass


@dataclass(frozen=True)
class Stop:
    pass


Message = Start | Forward | ForwardAhead | AllLogits | WarmUpDecode | Stop


def write_message(pipe: BinaryIO, message: Message) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    pipe.write(_LENGTH.pack(len(body)) + body)
    pipe.flush()


def read_message(pipe: BinaryIO) -> Message | None:
    """The next message, or None at the end of the pipe (rank 0 closed it or is gone)."""
    head = pipe.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (n,) = _LENGTH.unpack(head)
    body = pipe.read(n)
    if len(body) < n:
        return None
    return pickle.loads(body)
