"""One rank's shard of an engine's whole state dict (`parallel`'s module doc says which layer splits how).

The loader reads the engine's weight files memory-mapped and hands them here: each tensor of this rank is cut
out with `narrow` and copied (`clone`/`cat`), so a rank reads and holds its share of every tensor, never the
whole checkpoint. The rules go by the engine's tensor names (`models/llama.py`'s table) and hold for every
linear layer kind (`FloatLinear`, `Fp8Linear`, `Int8Linear`: weight [out, in], per-row `weight_scale` [out],
bias [out]); a name they do not know is refused, naming it, rather than loaded whole on every rank.

Imports: stdlib and torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from serving.engine.errors import EngineFormatError
from serving.engine.model import ModelArgs
from serving.engine.parallel import ParallelConfig

# column-parallel layers: the parts of their output rows, each split evenly over the ranks
COLUMN_PARTS: dict[str, Callable[[ModelArgs], list[int]]] = {
    "attention.wqkv": lambda a: [a.q_size, a.kv_size, a.kv_size],
    "feed_forward.w13": lambda a: [a.intermediate_size, a.intermediate_size],
}
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")  # input columns split, outputs summed by an all-reduce
VOCAB_PARALLEL = ("tok_embeddings", "output")  # rows of the vocabulary split (padded to a multiple of the size)
REPLICATED_SUFFIX = "norm.weight"  # every norm's weight, whole on every rank


def shard_state(state: Mapping[str, torch.Tensor], args: ModelArgs, parallel: ParallelConfig) -> dict[str, torch.Tensor]:
    """This rank's tensors of the whole state dict `state` of a model of `args` (whole, not sharded)."""
    if parallel.size == 1:
        return dict(state)
    return {name: _shard(name, t, args, parallel) for name, t in state.items()}


def _shard(name: str, t: torch.Tensor, args: ModelArgs, p: ParallelConfig) -> torch.Tensor:
    module, _, param = name.rpartition(".")
    layer = module.split(".", 2)[-1] if module.startswith("layers.") else module
    if name.endswith(REPLICATED_SUFFIX) or t.dim() == 0:
        return t.clone()
    if layer in COLUMN_PARTS:
        return torch.cat([_even_part(part, p) for part in t.split(COLUMN_PARTS[layer](args), dim=0)])
    if layer in ROW_PARALLEL:
        if param == "weight":
            return _even_part(t, p, dim=1)
        if param == "bias":  # added once: rank 0's shard
            return t.clone() if p.rank == 0 else torch.zeros_like(t)
        return t.clone()  # per-output-row scales: the outputs are whole on every rank
    if layer in VOCAB_PARALLEL:
        return _vocab_rows(t, args.vocab_size, p)
    raise EngineFormatError(f"tensor_parallel={p.size}: the engine's tensor {name!r} ({args.architecture}) has no "
                            "sharding rule (parallel_shard); this architecture is served with tensor_parallel 1")


def _even_part(t: torch.Tensor, p: ParallelConfig, dim: int = 0) -> torch.Tensor:
    """Rank `p.rank`'s 1/size of `t` along `dim`, copied out."""
    n = t.shape[dim] // p.size
    return t.narrow(dim, p.rank * n, n).clone()


def _vocab_rows(t: torch.Tensor, vocab_size: int, p: ParallelConfig) -> torch.Tensor:
    """Rows [rank * shard, (rank + 1) * shard) of a [vocab_size, ...] tensor, zero rows past the vocabulary."""
    shard = p.vocab_shard(vocab_size)
    first = p.rank * shard
    out = torch.zeros((shard, *t.shape[1:]), dtype=t.dtype)
    take = max(0, min(shard, vocab_size - first))
    if take:
        out[:take] = t.narrow(0, first, take)
    return out
