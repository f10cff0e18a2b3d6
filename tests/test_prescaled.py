"""Rows handed to an FP8 GEMM already scaled by the norm that wrote them (serving/engine/prescaled.py,
linear_quantized.prescale_rows_for): only on the tensor object that carries them, for as many rows, and only where
the GEMM would scale them in its Triton kernel. The kernels' values: tests/test_row_norm.py (interpreter)
and tests/test_paged_decode.py (the engine on CUDA, both ways to the bit)."""

from __future__ import annotations

import torch

from serving.engine.linear_quantized import QuantLinear, prescale_rows_for
from serving.engine.prescaled import prescaled_rows, with_prescaled_rows


def test_carried_rows_belong_to_the_tensor_object_and_its_row_count():
    x = torch.zeros(5, 8)
    q, scale = torch.zeros(5, 8, dtype=torch.float8_e4m3fn), torch.ones(5, 1)
    assert with_prescaled_rows(x, q, scale) is x
    assert prescaled_rows(x, 5) == (q, scale)
    assert prescaled_rows(x, 4) is None  # another row count: not these rows
    assert prescaled_rows(x.view(5, 8), 5) is None  # a view is another tensor object
    assert prescaled_rows(torch.zeros(5, 8), 5) is None


def test_norms_scale_rows_only_for_fp8_layers_past_the_decode_rows_on_cuda_when_on():
    from serving.engine.linear_float import FloatLinear
    from serving.engine.linear_fp8 import Fp8Linear
    from serving.engine.options import EngineOptions

    fp8 = QuantLinear(16, 32, method="fp8", bias=False, dtype=torch.bfloat16)
    int8 = QuantLinear(16, 32, method="int8-weight-only", bias=False, dtype=torch.bfloat16)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert prescale_rows_for(fp8, 65, cuda)  # on by default
    assert not prescale_rows_for(fp8, 64, cuda)  # the decode rows scale with torch ops
    assert not prescale_rows_for(fp8, 65, cpu)
    assert not prescale_rows_for(int8, 65, cuda)
    assert not prescale_rows_for(FloatLinear(16, 32), 65, cuda)
    off = Fp8Linear(16, 32, bias=False, dtype=torch.bfloat16)
    off.apply_options(EngineOptions(prescale_rows=False))
    assert not prescale_rows_for(off, 65, cuda)
    on = Fp8Linear(16, 32, bias=False, dtype=torch.bfloat16)
    on.apply_options(EngineOptions())
    assert not prescale_rows_for(on, 65, cuda)  # its weight is on the CPU: nothing to scale for
