"""The tiling of one decode GEMM kernel launch (`GemmConfig`), as the tuned tables and the kernels name it.

A config text is `<kernel>:n<BLOCK_N>:k<BLOCK_K>:s<split>:w<warps>:st<stages>`, e.g. `dot:n64:k128:s2:w4:st3`:
"dot" / "dott" (the product transposed) / "gemv" (one row), the output columns and reduction depth of a
program's tile, the K slices (split-K), the warps of a program and its software-pipelining stages.

A table is keyed by (rows bucket, N, K): rows bucket 1 for one row, `MAX_ROWS` for 2..`MAX_ROWS` rows (the
kernels pad the rows up to their block, so one config serves them all). The grouped expert GEMMs' tilings
(`GroupedConfig`) are keyed by (tokens, moe intermediate size, model dim): `moe_gemm.config_for`.

Imports: stdlib only (the tuned tables are read at load, before anything imports Triton).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

MAX_ROWS = 64  # more rows than this: no decode kernel, the layer's prompt-rows GEMM
CONFIG_TEXT = re.compile(r"(dott|dot|gemv):n(\d+):k(\d+):s(\d+):w(\d+):st(\d+)")

Shape = tuple[int, int, int]  # (rows bucket, N, K)


@dataclass(frozen=True)
class GemmConfig:
    kernel: str  # "dot" | "dott" | "gemv"
    block_n: int
    block_k: int
    split: int  # K slices, each a multiple of block_k
    warps: int = 4
    stages: int = 3

    def fits(self, m: int, n: int, k: int) -> bool:
        """Whether this config can run an [m, k] x [n, k]^T product (its K slices tile K exactly)."""
        if self.kernel == "gemv" and m != 1:
            return False
        return 1 <= m <= MAX_ROWS and k % (self.split * self.block_k) == 0

    def key(self) -> str:
        return f"{self.kernel}:n{self.block_n}:k{self.block_k}:s{self.split}:w{self.warps}:st{self.stages}"

    @classmethod
    def parse(cls, text: str) -> GemmConfig:
        """The config of a `key()` text."""
        match = CONFIG_TEXT.fullmatch(text)
        if match is None:
            raise ValueError(f"skinny GEMM config {text!r} is not like 'dot:n64:k128:s2:w4:st3'")
        kernel, *numbers = match.groups()
        return cls(kernel, *map(int, numbers))


GROUPED_TEXT = re.compile(r"m(\d+):n(\d+):k(\d+):w(\d+):st(\d+)")


@dataclass(frozen=True)
class GroupedConfig:
    """One grouped expert GEMM launch's tiling (`moe_gemm`): rows (sorted assignments), output columns and K a
    program, warps, stages. Text: `m<BLOCK_M>:n<BLOCK_N>:k<BLOCK_K>:w<warps>:st<stages>`, e.g. `m16:n64:k128:w4:st3`."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3

    def key(self) -> str:
        return f"m{self.block_m}:n{self.block_n}:k{self.block_k}:w{self.warps}:st{self.stages}"

    @classmethod
    def parse(cls, text: str) -> GroupedConfig:
        match = GROUPED_TEXT.fullmatch(text)
        if match is None:
            raise ValueError(f"grouped GEMM config {text!r} is not like 'm16:n64:k128:w4:st3'")
        return cls(*map(int, match.groups()))


def rows_bucket(m: int) -> int:
    return 1 if m == 1 else MAX_ROWS


def parse_table(table: Mapping[Shape, str], kind: type = GemmConfig) -> dict[Shape, GemmConfig]:
    """A table of config texts (`kind`'s), parsed once (the decode step looks configs up while dynamo traces it,
    and dynamo cannot trace into a C-implemented cache such as functools.cache on `parse`)."""
    return {shape: kind.parse(text) for shape, text in table.items()}
