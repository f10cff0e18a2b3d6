"""The issue-52 benchmark's harness on the CPU (tiny shape): FP8 weights made directly, and the decode timing of
tensor_parallel 1 beside 2 in one run (the device figures are bench/device_tensor_parallel.sh's)."""

from __future__ import annotations

import pytest
import torch

from bench.models import model_args
from bench.tensor_parallel import decode_tp, fp8_random_model
from serving.engine.linear_fp8 import Fp8Linear


def test_fp8_random_model_has_every_linear_in_fp8_and_computes():
    args = model_args("tiny")
    model = fp8_random_model(args, torch.device("cpu"), dtype=torch.float32, seed=1)
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 4 * args.n_layers and model.output is not None and not isinstance(model.output, Fp8Linear)
    assert all(m.weight.dtype == torch.float8_e4m3fn and bool((m.weight_scale > 0).all()) for m in linears)
    hidden = model(torch.tensor([[1, 2, 3, 4]]))
    assert hidden.shape == (1, 4, args.dim) and bool(hidden.isfinite().all())


@pytest.mark.slow
def test_decode_tp_times_each_size_in_one_run(tmp_path):
    report = decode_tp("tiny", tmp_path, sizes=(1, 2), prompt_len=8, gen_len=4, repeats=1, device="cpu")
    assert set(report["sizes"]) == {"1", "2"} and all(r["decode_tok_s"] > 0 for r in report["sizes"].values())
    assert report["speedup_over_tp1"]["1"] == 1.0
