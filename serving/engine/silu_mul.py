"""SiLU(gate) * up in one Triton kernel for the engine's eager GPU work (the engine's steps).

`silu_mul(gate_up [T, 2I], I)` -> [T, I]: the w13 projection's two halves combined. In torch that is
`F.silu(gate) * up` on two strided views: a kernel that writes SiLU(gate) and one that reads it back with up.
Here one pass reads both halves and writes the product, rounding as torch does (SiLU to the dtype, then the
product). The exponential may differ from torch's in the last float32 bit, so a value can land one step of
the dtype away (tests/test_silu_mul.py). Compiled code keeps the torch ops, which inductor fuses itself.
`silu_mul_e4m3` also scales each row it wrote to e4m3 for the FP8 GEMM of w2 (`serving.engine.prescaled`).
`gelu_tanh=True` (every function here) takes GELU with the tanh approximation instead of SiLU (Gemma's MLP:
`F.gelu(gate, approximate="tanh") * up`), computed as gate * sigmoid(2 u) = 0.5 gate (1 + tanh(u)), u =
sqrt(2 / pi) (gate + 0.044715 gate^3), with the same roundings.

Imports: torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import torch

from serving.engine.prescaled import E4M3_MAX, with_prescaled_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

DTYPES = (torch.bfloat16, torch.float16)
BLOCK = 1024  # columns a program

if triton is not None:

    @triton.jit
    def _activation(g, GELU_TANH: tl.constexpr):
        """SiLU of the float32 gate g, or with `GELU_TANH` its tanh-approximated GELU (module doc)."""
        if GELU_TANH:
            u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g^3)
            a = g / (1.0 + tl.exp(-2.0 * u))
        else:
            a = g / (1.0 + tl.exp(-g))
        return a

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr,
                         GELU_TANH: tl.constexpr = False):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
        silu = _activation(gate.to(tl.float32), GELU_TANH).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


    @triton.jit
    def _silu_mul_e4m3_kernel(x_ptr, out_ptr, q_ptr, scale_ptr, inter, stride_x, stride_o, QMAX: tl.constexpr,
                              BLOCK: tl.constexpr, GELU_TANH: tl.constexpr = False):
        """One row: SiLU(gate) * up as `_silu_mul_kernel` writes it, then that row scaled to e4m3 by its largest
        magnitude, as fp8_tokens scales a row (read back from what this program wrote)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        peak = tl.zeros((BLOCK,), tl.float32)
        for c0 in range(0, inter, BLOCK):
            cols = c0 + offs
            mask = cols < inter
            gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
            up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
            silu = _activation(gate.to(tl.float32), GELU_TANH).to(gate.dtype).to(tl.float32)
            y = (silu * up.to(tl.float32)).to(gate.dtype)
            tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
            peak = tl.maximum(peak, tl.abs(y.to(tl.float32)))
        amax = tl.max(peak, 0)
        scale = tl.where(amax > 0, amax * (1.0 / QMAX), 1.0)
        tl.debug_barrier()  # the row's values, as written, visible to every thread of the program
        for c0 in range(0, inter, BLOCK):
            cols = c0 + offs
            mask = cols < inter
            y = tl.load(out_ptr + row * stride_o + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(y / scale, -QMAX), QMAX)
            tl.store(q_ptr + row * inter + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)


def fits(gate_up: torch.Tensor) -> bool:
    """Whether `silu_mul` takes this projection: Triton importable, CUDA half precision, contiguous columns."""
    return triton is not None and gate_up.is_cuda and gate_up.dtype in DTYPES and gate_up.stride(-1) == 1


def silu_mul(gate_up: torch.Tensor, inter: int, *, gelu_tanh: bool = False) -> torch.Tensor:
    """`F.silu(gate) * up` of gate_up [..., 2 * inter] = [gate; up] -> [..., inter] (see the module doc);
    `gelu_tanh`: `F.gelu(gate, approximate="tanh") * up`."""
    x2 = gate_up.reshape(-1, gate_up.shape[-1])
    out = x2.new_empty(x2.shape[0], inter)
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(inter, BLOCK))](x2, out, inter, x2.stride(0), out.stride(0),
                                                               BLOCK=BLOCK, GELU_TANH=gelu_tanh, num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)


def silu_mul_e4m3(gate_up: torch.Tensor, inter: int, *, gelu_tanh: bool = False) -> torch.Tensor:
    """`silu_mul`'s result [T, inter] for gate_up [T, 2 * inter], carrying its rows scaled to e4m3 for an FP8
    GEMM (`serving.engine.prescaled`): one program a row, which scales what it wrote."""
    out = gate_up.new_empty(gate_up.shape[0], inter)
    q = torch.empty(out.shape, dtype=torch.float8_e4m3fn, device=out.device)
    scale = torch.empty(out.shape[0], 1, dtype=torch.float32, device=out.device)
    _silu_mul_e4m3_kernel[(out.shape[0],)](gate_up, out, q, scale, inter, gate_up.stride(0), out.stride(0),
                                          QMAX=E4M3_MAX, BLOCK=BLOCK, GELU_TANH=gelu_tanh, num_warps=4)
    return with_prescaled_rows(out, q, scale)


def gated(gate_up: torch.Tensor, inter: int, *, e4m3: bool = False, gelu_tanh: bool = False) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [..., 2 * inter]: the kernel for eager GPU work, the torch ops elsewhere (the CPU,
    and code being compiled, which inductor fuses). `e4m3`: with the kernel, rows [T, 2 * inter] in, the result
    carries its rows scaled to e4m3 (`silu_mul_e4m3`); `gelu_tanh`: GELU (tanh approximation) in place of SiLU."""
    if not torch.compiler.is_compiling() and fits(gate_up):
        if e4m3 and gate_up.dim() == 2:
            return silu_mul_e4m3(gate_up, inter, gelu_tanh=gelu_tanh)
        return silu_mul(gate_up, inter, gelu_tanh=gelu_tanh)
    gate, up = gate_up.split([inter, inter], dim=-1)
    if gelu_tanh:
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    return torch.nn.functional.silu(gate) * up
