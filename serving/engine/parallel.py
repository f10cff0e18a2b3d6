"""Tensor parallelism as data the layers are built with: `ParallelConfig` (this rank, the group's size and its
collectives), handed to the model's constructor.

A model of a group of `size` ranks holds, on each rank (Megatron-LM's split, as vLLM and TensorRT-LLM shard):

- `wqkv` column-parallel by heads: rank r computes its `n_heads / size` query heads and `n_kv_heads / size`
  KV heads (their rows of q, of k and of v); its attention runs over those heads only and its KV cache holds
  only them (the block tables are the same on every rank);
- `w13` column-parallel: its share of the gate's rows and the same share of up's;
- `wo` and `w2` row-parallel: the columns of its heads / its share of the intermediate features, their
  partial products summed by one all-reduce each (`all_reduce`); a bias is added once, by rank 0's shard;
- the embedding and the LM head vocabulary-parallel: rank r holds rows [r * shard, (r + 1) * shard) of the
  vocabulary (`vocab_shard`: the vocabulary padded up to a multiple of the size with zero rows); the embedding
  looks up the tokens of its rows and the all-reduce sums the ranks' (`VocabParallelEmbedding`), the head's
  logits are all-gathered and the padding cut (`gather_vocab`).

So `shard_args` is what the layers see: the same `ModelArgs` with the heads and the intermediate size divided
by `size`; the vocabulary stays whole (what requests are checked against). `check_tensor_parallel` refuses a
size that does not divide them, naming both. The weights: the engine folder holds the whole checkpoint and
each rank's loader slices its shard out of it (`parallel_shard.shard_state`), tensor by tensor from the
memory-mapped files, so a rank reads and holds its share only.

Size 1 (`SINGLE`) changes nothing: no collectives, the plain embedding.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine.errors import EngineLimitError
from serving.engine.model import ModelArgs
from serving.engine.parallel_group import Collectives


@dataclass(frozen=True)
class ParallelConfig:
    """This rank of a tensor-parallel group of `size` ranks; `group`: the collectives (None for size 1)."""

    rank: int = 0
    size: int = 1
    group: Collectives | None = None

    def shard_args(self, args: ModelArgs) -> ModelArgs:
        """The args this rank's layers are built with: heads and intermediate size divided by the size."""
        if self.size == 1:
            return args
        check_tensor_parallel(args, self.size)
        return dataclasses.replace(args, n_heads=args.n_heads // self.size, n_kv_heads=args.n_kv_heads // self.size,
                                   intermediate_size=args.intermediate_size // self.size)

    def vocab_shard(self, vocab_size: int) -> int:
        """Rows of the vocabulary each rank holds (the last rank's padded with zero rows)."""
        return -(-vocab_size // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial x (a row-parallel layer's output); x itself for size 1. A float32
        engine's row-parallel layers give float64 partials (`linear_float.RowParallelLinear`): summed in float64,
        then rounded to float32 once, at any size (size 1 included)."""
        total = x if self.group is None else self.group.all_reduce(x)
        return total.float() if total.dtype == torch.float64 else total

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """This rank's logits of its vocabulary rows [..., shard] -> every rank's [..., vocab_size]."""
        if self.group is None:
            return logits
        return self.group.all_gather(logits)[..., :vocab_size]


SINGLE = ParallelConfig()


def check_tensor_parallel(args: ModelArgs, size: int) -> None:
    """Refuse, naming both, a tensor-parallel size that does not divide the query heads, the KV heads or the
    MLP's intermediate size."""
    if size < 1:
        raise EngineLimitError(f"tensor_parallel={size} must be >= 1")
    for name, value in (("num_attention_heads", args.n_heads), ("num_key_value_heads", args.n_kv_heads),
                        ("intermediate_size", args.intermediate_size)):
        if value % size:
            raise EngineLimitError(f"tensor_parallel={size} does not divide {name}={value} of the model "
                                   f"({args.architecture}): pick a size that divides the heads")


def column_groups(args: ModelArgs) -> int:
    """The finest split of the row-parallel layers' input columns (wo's heads, w2's intermediate features) that a
    tensor-parallel size may make: every size `check_tensor_parallel` allows divides it, so each rank of any size
    holds whole groups (`linear_float.RowParallelLinear`). Of this rank's `args`: the group's count divided by the
    size."""
    return math.gcd(args.n_heads, args.n_kv_heads, args.intermediate_size)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [rank * shard, (rank + 1) * shard) of the embedding table (state dict as nn.Embedding's):
    a token outside them looks up zeros, and the all-reduce sums the ranks' lookups into the whole embedding."""

    def __init__(self, vocab_size: int, dim: int, parallel: ParallelConfig) -> None:
        shard = parallel.vocab_shard(vocab_size)
        super().__init__(shard, dim, _weight=torch.empty(shard, dim))
        self.parallel, self.first = parallel, parallel.rank * shard

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))
