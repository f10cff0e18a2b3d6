"""SiLU(gate) * up in one Triton kernel for the engine's eager GPU work (prefills, the paged engine's steps).

`silu_mul(gate_up [T, 2I], I)` -> [T, I]: the w13 projection's two halves combined. In torch that is
`F.silu(gate) * up` on two strided views: a kernel that writes SiLU(gate) and one that reads it back with up.
Here one pass reads both halves and writes the product, rounding as torch does (SiLU to the dtype, then the
product). The exponential may differ from torch's in the last float32 bit, so a value can land one step of
the dtype away (tests/test_silu_mul.py). Compiled code keeps the torch ops, which inductor fuses itself.

Imports: torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

DTYPES = (torch.bfloat16, torch.float16)
BLOCK = 1024  # columns a program

if triton is not None:

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def fits(gate_up: torch.Tensor) -> bool:
    """Whether `silu_mul` takes this projection: Triton importable, CUDA half precision, contiguous columns."""
    return triton is not None and gate_up.is_cuda and gate_up.dtype in DTYPES and gate_up.stride(-1) == 1


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """`F.silu(gate) * up` of gate_up [..., 2 * inter] = [gate; up] -> [..., inter] (see the module doc)."""
    x2 = gate_up.reshape(-1, gate_up.shape[-1])
    out = x2.new_empty(x2.shape[0], inter)
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(inter, BLOCK))](x2, out, inter, x2.stride(0), out.stride(0),
                                                               BLOCK=BLOCK, num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)


def gated(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [..., 2 * inter]: the kernel for eager GPU work, the torch ops elsewhere (the CPU,
    and code being compiled, which inductor fuses)."""
    if not torch.compiler.is_compiling() and fits(gate_up):
        return silu_mul(gate_up, inter)
    gate, up = gate_up.split([inter, inter], dim=-1)
    return torch.nn.functional.silu(gate) * up
