"""`bench kernel-resources` (bench/kernel_resources.py): the arithmetic everywhere; compiling for
sm_90 where Triton and its bundled NVIDIA tools are installed (not in CI: skipped)."""

from __future__ import annotations

import importlib.util

import pytest

from bench.kernel_resources import Resources, compile_offline

HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_programs_per_sm_is_the_tighter_of_registers_and_shared_memory():
    assert Resources(registers=255, stack=0, shared=0, warps=4).programs_per_sm() == 2  # 65,536 / (255 x 128)
    assert Resources(registers=128, stack=0, shared=0, warps=4).programs_per_sm() == 4
    assert Resources(registers=64, stack=0, shared=100 * 1024, warps=4).programs_per_sm() == 2  # 228 KB / 100 KB


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (with its bundled ptxas and cuobjdump)")
def test_the_fp8_gemm_compiles_for_hopper_without_spilling():
    from bench.kernel_resources import fp8_cases

    cases = fp8_cases()
    name, kernel, types, constexprs, warps, stages = next(c for c in cases if c[0].startswith("64 rows 4096x4096"))
    res = compile_offline(kernel, types, constexprs, warps=warps, stages=stages)
    assert res.stack == 0 and res.shared >= stages * 2 * 64 * constexprs["BLOCK_K"], (name, res)  # both e4m3 tiles
