"""Row reductions compiled in one pass over the row (serving/engine/whole_row_norms.py).

- CPU, every run: the context puts inductor's own choices back, even after an error; the compile options
  put the choice into the FX graph cache key; the decode graphs take it by default.
- CUDA (`gpu`): a residual add + RMSNorm of 64 rows compiles persistent at 2,048 columns and looped at
  4,096, persistent at 4,096 for one row, and computes what inductor's own kernels compute.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._inductor.codecache import FxGraphHashDetails
from torch._inductor.utils import run_and_get_code
from torch._inductor.virtualized import V

from serving.engine.cuda_graphs import DecodeGraphs
from serving.engine.whole_row_norms import WholeRowChoices, compile_options, whole_row_reductions

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_context_puts_inductors_choices_back():
    before = type(V.choices)
    with whole_row_reductions():
        assert isinstance(V.choices, WholeRowChoices)
    assert type(V.choices) is before
    with pytest.raises(RuntimeError), whole_row_reductions():
        raise RuntimeError("compile failed")
    assert type(V.choices) is before
    with whole_row_reductions(enabled=False):
        assert type(V.choices) is before


def test_a_compile_under_it_has_the_choice_in_the_fx_graph_cache_key():
    assert compile_options(False) == {}
    key_pass = compile_options(True)["post_grad_custom_post_pass"]
    assert key_pass.uuid().startswith("whole-row-norms:2048:4096:")
    with torch._inductor.config.patch(compile_options(True)):  # an unknown name raises AttributeError
        details = FxGraphHashDetails(torch.fx.symbolic_trace(lambda x: x + 1), [], {}, [])
        assert details.post_grad_custom_post_pass == key_pass.uuid()


def test_decode_graphs_take_it_by_default():
    assert inspect.signature(DecodeGraphs).parameters["whole_row_norms"].default is True


def residual_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    return x, h.to(x.dtype) * weight


def compiled_kernels(rows: int, columns: int, enabled: bool) -> tuple[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(rows + columns)
    x, residual = (torch.randn(rows, columns, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    weight = torch.randn(columns, device="cuda", generator=gen, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with whole_row_reductions(enabled):
        fn = torch.compile(residual_norm, fullgraph=True, options=compile_options(enabled))
        out, code = run_and_get_code(fn, x, residual, weight)
    return "\n".join(code), out


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize(("rows", "columns", "persistent"), [(64, 2048, True), (64, 4096, False), (1, 4096, True)])
def test_cuda_rows_compile_persistent_where_measured_faster_and_match(rows, columns, persistent):
    code, got = compiled_kernels(rows, columns, enabled=True)
    assert ("triton_per_fused" in code) is persistent
    assert ("triton_red_fused" in code) is not persistent
    own_code, want = compiled_kernels(rows, columns, enabled=False)
    assert "triton_red_fused" in own_code  # inductor alone loops over rows this long
    torch.testing.assert_close(got[0], want[0], rtol=0.0, atol=0.0)  # the residual sum: the same adds
    torch.testing.assert_close(got[1], want[1])  # the norm: sums of squares in another order
