"""An engine folder of a shape's random FP8 weights made on the device, with no bf16 model or HF checkpoint.

`bench.served.build_random_engine` draws a bf16 HF model, saves it, converts (quantizes) and builds it: for the
8B shape that is 16 GB written and read back before the 9 GB engine exists. Here the weights come from
`bench.tensor_parallel.fp8_random_model` (each linear drawn and quantized on the device, one tensor at a time),
go straight into an engine checkpoint (`checkpoint.json` + `weights-*.pt`, the layout `convert_checkpoint`
writes, each scale in its weight's file) and `build_engine` makes the folder from it, as for any checkpoint; the
checkpoint is then removed. The engine loads and serves like a converted one (same tensors, same record).

    python3 -m bench.fp8_engine --shape llama-3.1-8b --work /tmp/sl --max-batch-size 256 --max-seq-len 1024 \\
        --tokenizer /path/to/tokenizer-folder

Imports: torch and the engine at module import.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from serving.engine.build import EngineLimits, build_engine
from serving.engine.convert import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_FORMAT_VERSION,
    CHECKPOINT_JSON,
    TOKENIZER_FILES,
)
from serving.engine.kv_cache import KVCacheConfig
from serving.engine.models.registry import registered
from serving.engine.quantize import FP8, SCALE_SUFFIX, QuantInfo

SHARD_BYTES = 1 << 30  # weights a file holds, about


def dtype_for(device: torch.device) -> torch.dtype:
    """The engine's activation dtype where its weights are made: bf16 on a GPU, float32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def write_fp8_checkpoint(shape: str, out: Path, *, device: torch.device, tokenizer_dir: Path | None = None,
                         seed: int = 0, shard_bytes: int = SHARD_BYTES) -> Path:
    """Random FP8 weights of `shape` made on `device`, written as an engine checkpoint at `out` (with the tokenizer
    files found in `tokenizer_dir`); returns `out`."""
    from bench.models import model_args
    from bench.tensor_parallel import fp8_random_model

    args = model_args(shape)
    dtype = dtype_for(device)
    quant = QuantInfo(FP8)
    model = fp8_random_model(args, device, dtype=dtype, seed=seed)
    state = model.state_dict()
    del model
    quantized = {f"{m}.weight" for m in quant.quantized_modules(args.n_layers,
                                                               tie_word_embeddings=args.tie_word_embeddings)}
    expected = set(registered(args.architecture).param_names(args)) | {w + SCALE_SUFFIX for w in quantized}
    if set(state) != expected:
        raise ValueError(f"fp8_random_model({shape}) holds {sorted(set(state) - expected)[:8]} beyond the engine's "
                         f"tensors and lacks {sorted(expected - set(state))[:8]}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state, key=lambda n: (n.removesuffix(SCALE_SUFFIX), n)):  # a scale right after its weight
        tensor = state.pop(name)
        if size >= shard_bytes and not name.endswith(SCALE_SUFFIX):
            files.append({})
            size = 0
        files[-1][name] = tensor.cpu()
        size += tensor.numel() * tensor.element_size()
        del tensor
    weights: dict[str, str] = {}
    for i, part in enumerate(files):
        file = f"weights-{i + 1:05d}-of-{len(files):05d}.pt"
        torch.save(part, out / file)
        weights.update(dict.fromkeys(part, file))
    files.clear()
    for name in TOKENIZER_FILES:
        if tokenizer_dir is not None and (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
    meta = {"format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_FORMAT_VERSION,
            "dtype": str(dtype).removeprefix("torch."),
            "quantization": quant.to_dict(args.n_layers, tie_word_embeddings=args.tie_word_embeddings),
            "model": args.to_dict(), "weights": dict(sorted(weights.items())),
            "source": {"random_fp8": shape, "seed": seed}}
    (out / CHECKPOINT_JSON).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


def build_fp8_engine(shape: str, work: Path, *, device: torch.device, max_batch_size: int, max_seq_len: int,
                     kv_cache: KVCacheConfig | None = None, tokenizer_dir: Path | None = None) -> Path:
    """The engine folder `work`/engine-fp8-direct (module doc); kept when it is there already."""
    engine_dir = work / "engine-fp8-direct"
    if (engine_dir / "engine.json").is_file():
        return engine_dir
    checkpoint = write_fp8_checkpoint(shape, work / "ckpt-fp8-direct", device=device, tokenizer_dir=tokenizer_dir)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dtype = str(dtype_for(device)).removeprefix("torch.")
    limits = EngineLimits(dtype, max_batch_size=max_batch_size, max_input_len=max_seq_len - 1, max_seq_len=max_seq_len)
    path = build_engine(checkpoint, engine_dir, limits=limits, quantization=QuantInfo(FP8), kv_cache=kv_cache).path
    shutil.rmtree(checkpoint)
    return path


def main(argv: list[str] | None = None) -> int:
    from serving.engine.runner import resolve_device

    parser = argparse.ArgumentParser(prog="python -m bench.fp8_engine", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--work", type=Path, required=True, help="the engine goes to WORK/engine-fp8-direct")
    parser.add_argument("--device", default="auto", help="where the weights are made: auto, cuda or cpu")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--max-num-tokens", type=int, default=8192, help="the KV cache's tokens a step (prefill chunks)")
    parser.add_argument("--tokenizer", type=Path, help="a folder whose tokenizer files the engine gets")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    engine = build_fp8_engine(args.shape, args.work, device=resolve_device(args.device),
                              max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                              kv_cache=KVCacheConfig(max_num_tokens=args.max_num_tokens), tokenizer_dir=args.tokenizer)
    print(f"built in {time.perf_counter() - started:.1f} s: {engine}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
