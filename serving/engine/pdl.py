"""Programmatic dependent launch (PDL) for the engine's own Triton kernels.

A kernel launched with the PDL attribute (Hopper and later) may start while the kernel before it in the
stream is still finishing: its programs are placed on the SMs as the predecessor's drain, instead of
after the predecessor has exited and the launch has gone through. Each such kernel must wait
(`gdc_wait`) before it touches memory a predecessor may write or read, and it lets its own successor
launch (`gdc_launch_dependents`). Inductor generates this for its kernels with
`torch._inductor.config.triton.enable_pdl`; it launches the kernels of a `triton_op` itself, without
the attribute, so the decode step's GEMM and attention kernels have PDL variants registered as opaque
custom ops that launch them with it.

Imports: torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton
except ImportError:  # no Triton (CPU-only installs) or torch < 2.6
    triton = None

MIN_CAPABILITY = 9  # griddepcontrol: sm_90 (Hopper) and later


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with PDL (CUDA, compute capability 9.0 or later)."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= MIN_CAPABILITY


def launch_options(pdl: bool) -> dict[str, Any]:
    """The Triton launch keyword that sets the PDL attribute, or none."""
    return {"launch_pdl": True} if pdl else {}


def gdc(pdl: bool) -> bool:
    """Whether a kernel launched with `pdl` runs `gdc_enter`: not under TRITON_INTERPRET=1, whose
    sequential kernels have no predecessor running and which cannot execute the instructions. So the
    CPU tests run the PDL variants' ops, under torch.compile too, with the kernels' other code the same."""
    return pdl and os.environ.get("TRITON_INTERPRET") != "1"


def kernel_for(kernel: Any, pdl: bool) -> Any:
    """The kernel to launch from a custom op's body: as it is for the PDL variants (opaque to inductor,
    launched by Triton with the attribute), else through `wrap_triton`, which inductor traces."""
    return kernel if pdl else wrap_triton(kernel)


if triton is not None:

    @triton.jit
    def gdc_enter():
        """The start of a kernel launched with PDL: wait until the kernel before it has finished and its
        writes are visible, then let the kernel after it launch. In that order, so that a kernel that
        starts early can rely on every kernel before its predecessor having finished too."""
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
