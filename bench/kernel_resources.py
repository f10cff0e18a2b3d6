"""Registers, spills and shared memory of the decode step's Triton kernels, compiled for a GPU that is
not here: Triton compiles them for the target (Hopper, sm_90, by default) and `cuobjdump -res-usage`
reads the cubin. No GPU is needed, only Triton with its bundled NVIDIA tools.

`python3 -m bench kernel-resources` prints, for the skinny GEMM and the split-K FP8 GEMM (and its variant that scales one token itself) at the shipped configs of the Llama-1B and 8B decode shapes (and some alternatives), the registers
per thread, the bytes spilled to the stack, the shared memory and how many programs fit on one SM by
registers (65,536 per SM) and shared memory (228 KB). A memory-bound kernel with few programs per SM has few loads in flight.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024  # Hopper
RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


@dataclass(frozen=True)
class Resources:
    registers: int  # per thread
    stack: int  # bytes per thread: spills
    shared: int  # bytes per program (the dynamic shared memory Triton launches it with)
    warps: int

    def programs_per_sm(self) -> int:
        """Programs resident on one SM as far as registers and shared memory go."""
        by_registers = REGISTERS_PER_SM // (self.registers * 32 * self.warps)
        return min(by_registers, SHARED_PER_SM // self.shared) if self.shared else by_registers


def compile_offline(kernel: Any, types: dict[str, str], constexprs: dict[str, Any], *, warps: int, stages: int,
                    capability: int = 90) -> Resources:
    """Compile `kernel` (a `triton.jit` function) for CUDA compute capability `capability` and read its
    resource use; `types` gives the Triton type of each non-constexpr argument ("i32" when absent)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    # as Triton specializes a launch: pointers 16-byte aligned, integers that are multiples of 16 marked
    # so (every size and stride of the Llama decode shapes); without it no load is pipelined
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if signature[n].startswith("*") or signature[n] == "i32"}
    source = ASTSource(fn=kernel, signature=signature, attrs=aligned,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": warps, "num_stages": stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    found = RES_USAGE.search(report)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line for {kernel.__name__}:\n{report}")
    return Resources(int(found[1]), int(found[2]), int(compiled.metadata.shared), warps)


Case = tuple[str, Any, dict[str, str], dict[str, Any], int, int]  # name, kernel, types, constexprs, warps, stages


def h200_tables() -> Any:
    """The tuned kernel configs shipped for the H200 (serving/engine/tuned/NVIDIA_H200.json)."""
    from serving.engine.tuned_tables import TUNED_DIR, read_file

    return read_file(TUNED_DIR / "NVIDIA_H200.json")


def skinny_cases() -> list[Case]:
    """The skinny dot kernel with PDL at 64 rows, as tuned for the H200 (its `skinny` table); the LM heads also
    with their greedy maxima (`lm_head`)."""
    from bench.models import model_args
    from serving.engine.skinny_gemm import _dot_kernel

    cases = []
    for (rows, n, k), config in h200_tables().skinny.items():
        text = config.key()
        if rows != 64 or config.kernel != "dot":
            continue
        types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32" if config.split > 1 else "*bf16",
                 "max_ptr": "*fp32", "arg_ptr": "*i32"}
        lm_head = n == model_args("llama-3.2-1b").vocab_size  # both shapes' vocabulary
        for greedy in (False, True) if lm_head and config.split == 1 else (False,):
            constexprs = {"BLOCK_M": 64, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "IEEE_DOT": False,
                          "GDC": True, "GREEDY": greedy}
            name = f"{n}x{k} ({text}{', greedy' if greedy else ''})"
            cases.append((name, _dot_kernel, types, constexprs, config.warps, config.stages))
    return cases


def fp8_cases() -> list[Case]:
    """The split-K FP8 tensor-core kernel (`skinny_gemm`'s "dott" with e4m3 tokens) with PDL, as tuned
    for the H200 (its `fp8` table)."""
    from serving.engine.skinny_gemm import _dot_t_kernel, block_m

    cases = []
    for (rows, n, k), config in h200_tables().fp8.items():
        text = config.key()
        types = {"x_ptr": "*fp8e4nv", "x_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
                 "out_ptr": "*fp32" if config.split > 1 else "*bf16"}
        constexprs = {"BLOCK_M": block_m(rows), "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
                      "IEEE_DOT": False, "GDC": True, "SCALED": True, "TOKENS_SCALED": True}
        cases.append((f"{rows} rows {n}x{k} ({text})", _dot_t_kernel, types, constexprs, config.warps,
                      config.stages))
    return cases + fp8_one_row_cases()


def fp8_one_row_cases() -> list[Case]:
    """The FP8 kernel that scales its one bf16 token itself (`fp8_gemm._fp8_one_row_kernel`) with PDL, at the
    one-row configs of the H200's `fp8` table."""
    from serving.engine.fp8_gemm import ROW_BLOCK, _fp8_one_row_kernel
    from serving.engine.prescaled import E4M3_MAX

    cases = []
    for (rows, n, k), config in h200_tables().fp8.items():
        if rows != 1:
            continue
        text = config.key()
        types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
                 "out_ptr": "*fp32" if config.split > 1 else "*bf16"}
        constexprs = {"BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "ROW_BLOCK": ROW_BLOCK,
                      "QMAX": E4M3_MAX, "GDC": True}
        cases.append((f"1 row {n}x{k} ({text})", _fp8_one_row_kernel, types, constexprs, config.warps,
                      config.stages))
    return cases


def run_resources() -> list[dict[str, Any]]:
    """Print and return the resources of `skinny_cases` and `fp8_cases` on sm_90."""
    rows = []
    for name, kernel, types, constexprs, warps, stages in skinny_cases() + fp8_cases():
        res = compile_offline(kernel, types, constexprs, warps=warps, stages=stages)
        rows.append({"kernel": kernel.__name__, "case": name, "registers": res.registers, "spilled": res.stack,
                     "shared": res.shared, "warps": warps, "programs_per_sm": res.programs_per_sm()})
        print(f"{kernel.__name__:<13} {name:<42} {res.registers:>4} registers, {res.stack:>3} B spilled, "
              f"{res.shared:>6} B shared, {warps} warps: {res.programs_per_sm()} programs per SM", flush=True)
    return rows
