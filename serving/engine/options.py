"""How a loaded engine runs: one frozen `EngineOptions`, resolved once at load and passed down explicitly.

`resolve_options(device, engine_info, overrides)` reads the device (CUDA capability, Triton importable), the
engine record (its dtype) and the device's tuned kernel tables (`tuned_tables`), applies `overrides` (the
`llm` Triton model's parameters, a bench variant, a test) and returns the options; the runner hands them to the
model's layers (`linears.apply_options`: each linear picks its kernels then), to the step and to the kernels'
launchers. Nothing reads a module-level switch: a variant is a different `EngineOptions`
(`dataclasses.replace`, or `overrides`), so two engines in one process may run two variants side by side.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from serving.engine.errors import EngineLimitError
from serving.engine.speculative import SpeculativeOptions, parse_speculative
from serving.engine.tuned_tables import TunedTables, tables_for

# `engine_info` below is a `build.EngineInfo`, not imported: build imports the model, which imports this module
EngineInfo = Any

GEMM_CHOICES = ("auto", "triton", "torch")


@dataclass(frozen=True)
class AttentionKernelOptions:
    """The paged decode attention kernel's launch (`paged_attention.paged_decode_triton`)."""

    # one block an iteration, the next block's table entry loaded an iteration ahead and V loaded with K: an
    # iteration waits for one memory round trip instead of three in a row (table, K, V)
    prefetch_blocks: bool = True
    # over an e4m3 pool with bf16 queries, the dots in float16 (e4m3 widens to float16 in one instruction a pair
    # on sm_89+, to bf16 through several)
    fp8_kv_dot_f16: bool = True
    tile_positions: int | None = None  # positions an iteration walks (a power of two >= 16), None: one block
    num_warps: int = 4  # warps a program over a bf16 / float32 pool (and over an e4m3 one whose positions split)
    fp8_num_warps: int = 1  # warps a program over an e4m3 pool, positions not split
    num_stages: int | None = None  # software-pipelining stages, None: Triton's default

    def __post_init__(self) -> None:
        tile = self.tile_positions
        if tile is not None and (tile < 16 or tile & (tile - 1)):
            raise EngineLimitError(f"attention.tile_positions={tile}: expected a power of two >= 16, or None")


@dataclass(frozen=True)
class EngineOptions:
    """Every choice of how a loaded engine computes, with its default (docs/engine.md: what each one trades)."""

    # the decode rows' GEMMs (1-64 rows): "triton" the tuned skinny / split-K FP8 / gate-up kernels where the
    # device's tables have the shape, "torch" F.linear (cuBLAS) and the layers' own prompt GEMMs
    decode_gemm: str = "torch"
    decode_gate_up: bool = True  # with "triton" GEMMs: silu(gate) * up in one kernel where tuned (gate_up.py)
    decode_pdl: bool = False  # the paged decode graphs' kernels with programmatic dependent launch (sm_90+)
    # the norms and SiLU * up writing an fp8 GEMM's input of more than the decode rows also scale its rows to
    # e4m3 (serving.engine.prescaled), instead of a kernel of the GEMM's own
    prescale_rows: bool = True
    # `_scaled_mm(use_fast_accum=)` in the fp8 prompt GEMMs: FP8 MMAs accumulating without periodic promotion
    # to float32, as vLLM's and TensorRT-LLM's FP8 GEMM kernels do (quality: docs/quantization.md)
    fp8_fast_accum: bool = True
    fp8_row_scaling_in_kernel: bool = False  # one token's e4m3 scaling inside its split-K FP8 GEMM (fp8_gemm.py)
    # fp8 layers at decode rows may use the FP8 tensor cores (the split-K kernel where tuned, `_scaled_mm` for
    # 16-64 rows of wide outputs); False: the weight-only decode kernels alone
    fp8_decode_tensor_cores: bool = True
    partial_sums_one_kernel: bool = True  # eager split-K sums on CUDA as one Triton kernel (partials.py)
    gqa_in_sdpa: bool = True  # CUDA prompt attention: SDPA's grouped heads, not K/V copied to every query head
    # mixtures of experts on CUDA: a decode step's routing and the grouped GEMMs' alignment in one launch
    # (moe_routing.py) where the batch fits one program; False: the torch ops (about twenty kernels a layer)
    moe_fused_routing: bool = True
    attention: AttentionKernelOptions = AttentionKernelOptions()
    # speculative decoding by n-gram lookup in each request's own tokens (speculative.py); None: off
    speculative: SpeculativeOptions | None = None
    tuned: TunedTables = field(default_factory=TunedTables)  # the device's tuned decode kernel configs (tuned_tables.py)

    def __post_init__(self) -> None:
        if self.decode_gemm not in GEMM_CHOICES[1:]:
            raise EngineLimitError(f"decode_gemm={self.decode_gemm!r}: expected one of {list(GEMM_CHOICES[1:])}")

    @property
    def triton_gemms(self) -> bool:
        return self.decode_gemm == "triton"


OVERRIDABLE = tuple(f.name for f in dataclasses.fields(EngineOptions) if f.name != "tuned")


def resolve_options(device: torch.device, engine_info: EngineInfo | None = None,
                    overrides: Mapping[str, Any] | None = None, *, tuned: TunedTables | None = None
                    ) -> EngineOptions:
    """The options of an engine loaded on `device`: "auto" choices resolved for the device and the engine's
    dtype, the device's tuned tables (`tuned`: these instead), then `overrides` (any field but `tuned`;
    `attention` as a mapping of `AttentionKernelOptions` fields, or one; `speculative` as
    `speculative.parse_speculative` reads it). A bad name or value raises `EngineLimitError` naming it."""
    given = dict(overrides or {})
    unknown = sorted(set(given) - set(OVERRIDABLE))
    if unknown:
        raise EngineLimitError(f"engine options {unknown} are not known; known: {list(OVERRIDABLE)}")
    dtype = engine_dtype(engine_info)
    tables = tables_for(device) if tuned is None else tuned
    given["decode_gemm"] = pick_decode_gemm(given.get("decode_gemm", "auto"), device, dtype, tables)
    attention = given.get("attention")
    if isinstance(attention, Mapping):
        names = {f.name for f in dataclasses.fields(AttentionKernelOptions)}
        if set(attention) - names:
            raise EngineLimitError(f"engine option attention: {sorted(set(attention) - names)} are not known; "
                                   f"known: {sorted(names)}")
        given["attention"] = AttentionKernelOptions(**attention)
    if "speculative" in given:
        given["speculative"] = parse_speculative(given["speculative"])
    return EngineOptions(tuned=tables, **given)


def engine_dtype(engine_info: EngineInfo | None) -> torch.dtype:
    """The engine's dtype ("float32" -> torch.float32; limits.dtype is checked when engine.json is read)."""
    return torch.bfloat16 if engine_info is None else getattr(torch, engine_info.limits.dtype)


def pick_decode_gemm(choice: str, device: torch.device, dtype: torch.dtype, tables: TunedTables) -> str:
    """"auto" -> "triton" for a half-precision model on a GPU that has tuned tables (`tuned_tables`) when Triton
    is importable, else "torch"; "triton" where that is not so is refused, naming what is missing."""
    if choice not in GEMM_CHOICES:
        raise EngineLimitError(f"decode_gemm={choice!r}: expected 'auto', 'triton' or 'torch'")
    if choice == "torch" or (choice == "auto" and (device.type != "cuda" or dtype == torch.float32)):
        return "torch"
    from serving.engine.skinny_gemm import triton_available

    if triton_available() and device.type == "cuda" and tables.source != "none":
        return "triton"
    if choice == "triton":
        where = (f"{torch.cuda.get_device_name(device)} (compute capability "
                 f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
                 if device.type == "cuda" else f"device {device}")
        raise EngineLimitError(
            f"decode_gemm='triton' needs Triton and a GPU with tuned kernel tables (serving/engine/tuned/, by "
            f"device name or compute capability); here: {where}, Triton "
            f"{'importable' if triton_available() else 'not importable'}. Use decode_gemm='torch', or tune this "
            f"GPU with the GEMM sweeps (bench gemms)")
    return "torch"


def with_tuned(options: EngineOptions, **tables: Any) -> EngineOptions:
    """`options` with some tuned tables replaced (`tables`: section name -> {shape: GemmConfig}): a sweep or a
    test running configs of its own."""
    return dataclasses.replace(options, tuned=dataclasses.replace(options.tuned, source="given", **tables))

