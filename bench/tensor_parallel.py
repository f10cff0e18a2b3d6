"""Issue 52's device figures: tensor parallelism's decode at batch 1, and 70B-class shapes on one GPU in FP8.

- `decode_tp`: one random-weight engine of a shape (bf16, built once: `bench.served.build_random_engine`) and the
  same checkpoint built again with `tensor_parallel` N, each loaded as the `llm` model loads it (`load_engine`:
  rank 0 here, the other ranks its worker processes on the next GPUs) and timed by `time_generate` at batch 1,
  one after the other in one process; the report has each size's decode tok/s and their ratio to size 1.
  `python -m bench.tensor_parallel decode --shape llama-3.1-8b --sizes 1,2` (a 2-GPU host).
- `fp8_random_model`: a `Transformer` of a shape with random FP8 weights made on the device tensor by tensor
  (each linear layer's bf16 draw quantized per row and dropped before the next), so a 70B shape never needs its
  bf16 weights (140 GB) on the GPU or on the disk; `bench throughput --fp8-direct` runs on it
  (bench/device_tensor_parallel.sh).

Imports: torch and the engine at module import; the HF side (transformers) only through `build_random_engine`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

from serving.engine.linear_quantized import QuantLinear
from serving.engine.linears import install_quantized_linears
from serving.engine.model import ModelArgs
from serving.engine.models.llama import Transformer
from serving.engine.quantize import FP8, QuantInfo, quantize_weight

WEIGHT_STD = 0.02  # the HF initializer_range the other random-weight benchmarks draw with


def fp8_random_model(args: ModelArgs, device: torch.device, *, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """A model of `args` with random weights, its linear layers in FP8 (per-row scales; the LM head, the
    embedding and the norms in `dtype`), made on `device` one tensor at a time (module doc)."""
    with torch.device("meta"):
        model = Transformer(args)
    install_quantized_linears(model, QuantInfo(FP8), n_layers=args.n_layers,
                              tie_word_embeddings=args.tie_word_embeddings, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    quantized = {name for name, module in model.named_modules() if isinstance(module, QuantLinear)}
    state: dict[str, torch.Tensor] = {}
    for name, meta in model.state_dict().items():
        module, _, param = name.rpartition(".")
        if module in quantized:
            if param == "weight":
                draw = torch.randn(meta.shape, dtype=dtype, device=device, generator=generator) * WEIGHT_STD
                state[name], state[f"{module}.weight_scale"] = quantize_weight(draw, FP8)
                del draw
            elif param == "bias":
                state[name] = torch.zeros(meta.shape, dtype=dtype, device=device)
        elif name.endswith("norm.weight"):
            state[name] = torch.ones(meta.shape, dtype=dtype, device=device)
        else:
            state[name] = torch.randn(meta.shape, dtype=dtype, device=device, generator=generator) * WEIGHT_STD
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def decode_tp(shape: str, work: Path, *, sizes: tuple[int, ...], prompt_len: int, gen_len: int, repeats: int = 3,
              device: str = "auto") -> dict[str, Any]:
    """Decode at batch 1 of `shape` at each tensor-parallel size (module doc) -> the report."""
    from bench.served import build_random_engine
    from serving.engine import build_engine, load_engine, read_engine_info
    from serving.engine.timing import time_generate

    work.mkdir(parents=True, exist_ok=True)
    one = build_random_engine(shape, work, max_batch_size=1, max_seq_len=prompt_len + gen_len + 1)
    info = read_engine_info(one)
    report: dict[str, Any] = {"shape": shape, "prompt_len": prompt_len, "gen_len": gen_len, "batch": 1, "sizes": {}}
    for size in sizes:
        engine = one if size == 1 else build_engine(work / "ckpt", work / f"engine-tp{size}", limits=info.limits,
                                                    kv_cache=info.kv_cache, tensor_parallel=size).path
        runner = load_engine(engine, device=device)
        try:
            runner.warm_up_prefill(prompt_len)
            cell = time_generate(runner, batch=1, prompt_len=prompt_len, gen_len=gen_len, repeats=repeats,
                                 shape=f"{shape} tp{size}", impl="engine")
        finally:
            runner.close()
        report["sizes"][str(size)] = {"decode_tok_s": cell.decode_tok_s, "tpot_ms_p50": cell.tpot_ms_p50,
                                      "e2e_tok_s": cell.e2e_tok_s, "ttft_ms_p50": cell.ttft_ms_p50,
                                      "device": str(runner.device)}
        print(f"{shape} tensor_parallel={size}: decode {cell.decode_tok_s:.1f} tok/s, TPOT p50 "
              f"{cell.tpot_ms_p50:.3f} ms", flush=True)
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = report["sizes"].get("1")
    if base is not None:
        report["speedup_over_tp1"] = {size: row["decode_tok_s"] / base["decode_tok_s"]
                                      for size, row in report["sizes"].items()}
    report["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tensor_parallel", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    dec = sub.add_parser("decode", help="decode at batch 1 at each tensor-parallel size, one after the other")
    dec.add_argument("--shape", default="llama-3.1-8b")
    dec.add_argument("--sizes", default="1,2", help="comma list of tensor_parallel sizes (1 first: the baseline)")
    dec.add_argument("--workload", default="128/128", help="prompt/generated tokens")
    dec.add_argument("--repeats", type=int, default=3)
    dec.add_argument("--device", default="auto")
    dec.add_argument("--work", type=Path, default=Path("/tmp/bench-tp"), help="random checkpoint and engines")
    dec.add_argument("--out", type=Path, default=Path("bench-tensor-parallel.json"))
    args = parser.parse_args(argv)
    prompt_len, gen_len = (int(x) for x in args.workload.split("/"))
    report = decode_tp(args.shape, args.work, sizes=tuple(int(s) for s in args.sizes.split(",")),
                       prompt_len=prompt_len, gen_len=gen_len, repeats=args.repeats, device=args.device)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report.get("speedup_over_tp1", {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
