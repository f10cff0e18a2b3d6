"""The decode step's LM head with its greedy tokens: no pass over the logits after the GEMM.

Before, the step wrote the LM head's bf16 logits, converted them to float32 and ran a two-stage argmax
over them (Llama-1B at batch 64 on the H200: 22 us, 2% of the step). Here the skinny GEMM's kernel
(`skinny_gemm`, "dot", one K slice) also writes each row's largest rounded logit of its column tile and
that column ([M, V / BLOCK_N], 2,004 tiles at the Llama vocabulary), and `greedy_from_tiles` picks the
best tile of each row: a reduction over 2,004 values instead of 128,256. Ties go to the lowest column,
as argmax's. The logits stay in the model's dtype (`sampling` computes in float32 itself); where no
tuned one-slice config fits, the step keeps float32 logits and `model.greedy_tokens`.

On an H200 (`bench profile`, same process): Llama-1B at batch 64 1.077 against 1.098 ms per step,
Llama-8B at batch 64 4.766 against 4.793 ms; at batch 1 a tie. Checked on CPU tensors under
TRITON_INTERPRET=1 and on the GPU (tests/test_lm_head.py), and in the bf16 parity test.

Registered as the custom op `enginewright::lm_head_greedy` (opaque to inductor; PDL when `pdl`).
Imports: stdlib and torch; Triton only if importable.
"""

from __future__ import annotations

import torch

from serving.engine import skinny_gemm
from serving.engine.skinny_gemm import GemmConfig, empty_partials, kernel_config, tile_maxima
from serving.engine.tuned_tables import TunedTables

try:
    import triton
except ImportError:  # no Triton (CPU-only installs) or torch < 2.6
    triton = None


def head_config(x: torch.Tensor, weight: torch.Tensor, tables: TunedTables) -> GemmConfig | None:
    """The tuned config of the head's product (`skinny_gemm.kernel_config`) if it is a one-slice "dot"
    config, else None."""
    config = kernel_config(x, weight, tables=tables)
    return config if config is not None and config.kernel == "dot" and config.split == 1 else None


def greedy_from_tiles(maxima: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token [M] (int64) from its tiles' maxima and their columns [M, T]."""
    best = maxima.argmax(dim=-1, keepdim=True)  # the first tile holding the row's maximum
    return columns.gather(-1, best).squeeze(-1).long()


if triton is not None:

    @torch.library.custom_op("enginewright::lm_head_greedy", mutates_args=())
    def _lm_head_greedy_op(x: torch.Tensor, weight: torch.Tensor, config: str, pdl: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        parsed = GemmConfig.parse(config)
        greedy = tile_maxima(x, weight.shape[0], parsed.block_n)
        logits = skinny_gemm.launch(x, weight, parsed, pdl=pdl, greedy=greedy)[0]
        return logits, *greedy

    @_lm_head_greedy_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, config: str, pdl: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        parsed = GemmConfig.parse(config)
        return empty_partials(x, weight.shape[0], parsed)[0], *tile_maxima(x, weight.shape[0], parsed.block_n)


def lm_head_greedy(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig, *, pdl: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [M, V] in x's dtype, greedy tokens [M]) of rows x [M, D] and the head's weight [V, D], in
    one kernel and a reduction over its tiles (CUDA; CPU under TRITON_INTERPRET=1). `config`: a "dot"
    config with one K slice."""
    if triton is None:
        raise RuntimeError("Triton (and torch >= 2.6) is needed for the LM head's kernel")
    logits, maxima, columns = torch.ops.enginewright.lm_head_greedy(x, weight, config.key(), pdl)
    return logits, greedy_from_tiles(maxima, columns)
