"""HF checkpoint -> engine checkpoint: rename, fuse q/k/v and gate/up, cast dtype, quantize, shard by shard.

The input is a Hugging Face folder (`config.json` + `*.safetensors`, sharded with
`model.safetensors.index.json` or not). The output is an *engine checkpoint*, loadable with torch
alone (`torch.load(weights_only=True, mmap=True)`):

    checkpoint.json                       format, dtype, quantization, model args, tensor -> file map
    weights-00001-of-0000N.pt ...         torch.save of a name -> tensor dict each, about a quarter of
                                          the largest input shard per file
    tokenizer.json, tokenizer_config.json, ...   copied along when present

Tensors are read one at a time from each shard (the safetensors header parsed here, the bytes read
with `readinto` into the tensor: no mmap, whose pages count in RSS), cast, and written out in
files of about a quarter shard; a fused tensor whose parts straddle two shards waits in a small
pending buffer (a mixture of experts' stacked tensor is allocated whole at its first expert and filled in
place). Peak memory stays under the largest shard (measured: tests/test_engine_convert.py
prints it), not the model. The output is written into a temp sibling and renamed at the end.

Imports at module load: stdlib and torch only (no safetensors needed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from serving.engine.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    EngineExistsError,
    EngineLimitError,
)
from serving.engine.fp8_checkpoint import (
    UnsupportedQuantizationError,
    detect_fp8_checkpoint,
    fp8_quantization,
)
from serving.engine.model import ModelArgs
from serving.engine.models.registry import model_args_of, registered
from serving.engine.quantize import SCALE_SUFFIX, QuantInfo, quantize_weight

CHECKPOINT_FORMAT = "enginewright-torch-checkpoint"
CHECKPOINT_FORMAT_VERSION = 1
CHECKPOINT_JSON = "checkpoint.json"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "tokenizer.model", "chat_template.jinja")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # one expert's tensor of a mixture of experts (`models.moe`)


def parse_dtype(dtype: str, *, setting: str = "dtype") -> torch.dtype:
    if dtype not in DTYPES:
        raise EngineLimitError(f"{setting}={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def map_hf_name(name: str, args: ModelArgs) -> tuple[str, int, int] | None:
    """HF tensor name -> (engine name, part, n_parts) by the weight table of `args.architecture`
    (`models.registry`); None for tensors the engine drops."""
    arch = registered(args.architecture)
    if arch.ignored_weights.fullmatch(name) or (name == "lm_head.weight" and args.tie_word_embeddings):
        return None
    m = _LAYER.match(name)
    key, layer = (f"model.layers.{{i}}.{m.group(2)}", m.group(1)) if m else (name, None)
    expert = _EXPERT.search(key)
    if expert is not None:  # expert e's parts follow those of experts 0..e-1 in the stacked tensor
        key = f"{key[:expert.start()]}.experts.{{e}}.{key[expert.end():]}"
    if key not in arch.weights or (expert is not None and int(expert.group(1)) >= args.n_experts):
        raise CheckpointError(f"unexpected tensor {name!r}: not in the HF->engine weight table for "
                              f"{args.architecture}" + (f" ({args.n_experts} experts)" if expert else ""))
    target, part, n_parts = arch.weights[key]
    if expert is not None:
        part, n_parts = int(expert.group(1)) * n_parts + part, args.n_experts * n_parts
    return (target.format(i=layer) if layer is not None else target), part, n_parts


def read_hf_config(hf_dir: Path) -> tuple[dict[str, Any], ModelArgs]:
    if not hf_dir.is_dir():
        raise CheckpointNotFoundError(f"HF checkpoint folder {str(hf_dir)!r} does not exist")
    path = hf_dir / "config.json"
    if not path.is_file():
        raise CheckpointNotFoundError(f"HF checkpoint folder {str(hf_dir)!r} has no config.json ({path})")
    config = json.loads(path.read_text())
    return config, model_args_of(config, source=str(path))


def list_shards(hf_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in index order when sharded."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        shards = [hf_dir / f for f in files]
        missing = [str(s) for s in shards if not s.is_file()]
        if missing:
            raise CheckpointNotFoundError(f"shards listed in {index} are missing: {missing}")
        return shards
    shards = sorted(hf_dir.glob("*.safetensors"))
    if not shards:
        found = sorted(p.name for p in hf_dir.iterdir())
        raise CheckpointNotFoundError(f"no *.safetensors in {str(hf_dir)!r} (found {found}); "
                                      "only safetensors checkpoints are supported")
    return shards


# safetensors dtype codes -> torch dtypes (the ones a Llama-family checkpoint can hold)
_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_safetensors_header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """({tensor name: {dtype, shape, data_offsets}}, byte offset of the data) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its header length)")
        n = int.from_bytes(raw, "little")
        if n > 100 * 2**20:
            raise CheckpointError(f"{path}: safetensors header of {n} bytes is implausible")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"{path}: unreadable safetensors header: {exc}") from exc
    header.pop("__metadata__", None)
    return header, 8 + n


def _read_tensor(f: Any, entry: dict[str, Any], data_start: int, *, path: Path, name: str) -> torch.Tensor:
    """One tensor read with `readinto` straight into a fresh tensor: no mmap (whose pages would count in
    RSS until the file is closed), no intermediate bytes object."""
    import ctypes

    dtype = _ST_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {entry['dtype']!r}, not supported")
    begin, end = entry["data_offsets"]
    t = torch.empty(entry["shape"], dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if end - begin != nbytes:
        raise CheckpointError(f"{path}: tensor {name!r} spans {end - begin} bytes, its shape needs {nbytes}")
    if nbytes:
        f.seek(data_start + begin)
        view = memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")
        got = 0
        while got < nbytes:
            k = f.readinto(view[got:])
            if not k:
                raise CheckpointError(f"{path}: truncated while reading tensor {name!r}")
            got += k
    return t


def convert_checkpoint(hf_dir: Path, out_dir: Path, *, dtype: str,
                       progress: Callable[[str], None] | None = None,
                       flush_bytes: int | None = None, quantization: QuantInfo | None = None) -> Path:
    """Convert an HF Llama-family checkpoint into an engine checkpoint at `out_dir`; returns `out_dir`.

    Tensors are read one at a time (in file order), cast, and buffered until `flush_bytes` (default: a
    quarter of the largest input shard, at least 4 MiB) are waiting, then written as one
    `torch.save`'d file; so peak memory is about that buffer plus the tensor in hand and the fused
    parts still waiting for their siblings, not a whole shard (and never the model).
    `quantization` (`serving.engine.quantize`): each tensor it quantizes is quantized as soon as it is
    complete (fused), its scale written beside it; the same bounded memory. A checkpoint already in FP8
    (`fp8_checkpoint`) keeps its e4m3 weights and takes its own scales in the engine's layout (`quantization`
    must then be fp8).
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    target_dtype = parse_dtype(dtype)
    quant = quantization or QuantInfo()
    config, args = read_hf_config(hf_dir)
    quant.validate(tie_word_embeddings=args.tie_word_embeddings)
    fp8 = detect_fp8_checkpoint(hf_dir, config)
    if fp8 is not None:
        quant = fp8_quantization(fp8, quant, where=str(hf_dir))
    quantized = {f"{m}.weight" for m in quant.quantized_modules(args.n_layers,
                                                               tie_word_embeddings=args.tie_word_embeddings)}
    shards = list_shards(hf_dir)
    shapes = {k: v["shape"] for s in shards for k, v in read_safetensors_header(s)[0].items()} if fp8 else {}
    if out_dir.exists():
        raise EngineExistsError(f"convert output {str(out_dir)!r} already exists; remove it or pick another")
    if flush_bytes is None:
        flush_bytes = max(4 * 2**20, max(p.stat().st_size for p in shards) // 4)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        pending: dict[str, dict[int, torch.Tensor]] = {}  # fused tensors still missing parts
        stacks: dict[str, _Stack] = {}  # experts' stacked tensors still missing parts, filled in place
        weights: dict[str, str] = {}  # engine tensor name -> file (temporary names until the end)
        files: list[str] = []
        out: dict[str, torch.Tensor] = {}
        buffered = 0

        def flush() -> None:
            nonlocal out, buffered
            if not out:
                return
            file = f"part-{len(files) + 1:05d}.pt"
            torch.save(out, tmp / file)
            files.append(file)
            weights.update(dict.fromkeys(out, file))
            out, buffered = {}, 0

        def put(target: str, t: torch.Tensor) -> None:
            nonlocal buffered
            if target not in quantized and t.dtype == torch.float8_e4m3fn:
                raise UnsupportedQuantizationError(f"{target}: FP8 in {str(hf_dir)!r}, but the engine keeps it in "
                                                   f"{dtype} (it quantizes the layers' projections only)")
            if target in quantized and fp8 is None:
                t, scale = quantize_weight(t, quant.method)
                out[target + SCALE_SUFFIX] = scale
                buffered += scale.numel() * scale.element_size()
            out[target] = t
            buffered += t.numel() * t.element_size()
            if buffered >= flush_bytes:
                flush()

        n = len(shards)
        for i, shard in enumerate(shards):
            header, data_start = read_safetensors_header(shard)
            ordered = sorted(header, key=lambda k: header[k]["data_offsets"][0])  # sequential reads
            count = 0
            with open(shard, "rb", buffering=0) as f:
                for name in ordered:
                    if fp8 is not None and fp8.unused(name):
                        continue
                    scaled = fp8.weight_of_scale(name) if fp8 is not None else None
                    mapped = map_hf_name(scaled or name, args)
                    if mapped is None:
                        continue
                    target, part, n_parts = mapped
                    t = _read_tensor(f, header[name], data_start, path=shard, name=name)
                    if t.dim() == 3:  # experts already stacked [E, N, K]: the engine stacks them on the rows
                        t = t.flatten(0, 1)
                    if scaled is not None:  # the checkpoint's scale of an FP8 weight, in the engine's layout
                        target += SCALE_SUFFIX
                        t = fp8.engine_scale(t, shapes[scaled], name=name, fused=n_parts > 1)
                    elif fp8 is not None and target in quantized:
                        fp8.check_weight(name, t)  # e4m3, kept as it is
                    elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and fp8 is None:
                        raise CheckpointError(f"{shard}: tensor {name!r} is {t.dtype} but {hf_dir / 'config.json'} "
                                              "has no quantization_config saying how it is scaled")
                    elif t.is_floating_point() and t.dtype != target_dtype and t.dtype != torch.float8_e4m3fn:
                        t = t.to(target_dtype)  # the source copy is freed here (last reference)
                    count += 1
                    if n_parts == 1:
                        put(target, t)
                        continue
                    if n_parts >= STACKED_MIN_PARTS:  # experts: no list of parts and a copy of them all at the end
                        stack = stacks.setdefault(target, _Stack(n_parts, t))
                        if stack.add(part, t, name=name):
                            put(target, stacks.pop(target).tensor)
                        del t, stack
                        continue
                    parts = pending.setdefault(target, {})
                    parts[part] = t
                    del t
                    if len(parts) == n_parts:
                        fused = torch.cat([parts[p] for p in range(n_parts)], dim=0)
                        del pending[target], parts
                        put(target, fused)
                        del fused
            if progress is not None:
                progress(f"shard {i + 1}/{n}: {shard.name} ({count} tensors read, {len(files)} files written)")
        flush()
        # final names: weights-0000i-of-0000N.pt (the layout loaders know: any number of dict files)
        names = {old: f"weights-{k + 1:05d}-of-{len(files):05d}.pt" for k, old in enumerate(files)}
        for old, new in names.items():
            os.rename(tmp / old, tmp / new)
        weights = {k: names[v] for k, v in weights.items()}
        if pending or stacks:
            present = {**{k: sorted(v) for k, v in pending.items()}, **{k: sorted(v.parts) for k, v in stacks.items()}}
            raise CheckpointError(f"fused tensors incomplete after all shards of {str(hf_dir)!r}: "
                                  f"{present} (parts present)")
        expected = set(registered(args.architecture).param_names(args)) | {name + SCALE_SUFFIX for name in quantized}
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        if missing or extra:
            raise CheckpointError(f"checkpoint {str(hf_dir)!r} does not match {args.architecture} config: "
                                  f"missing engine tensors {missing[:8]}, unexpected {extra[:8]}")
        meta = {
            "format": CHECKPOINT_FORMAT,
            "format_version": CHECKPOINT_FORMAT_VERSION,
            "dtype": dtype,
            "quantization": quant.to_dict(args.n_layers, tie_word_embeddings=args.tie_word_embeddings),
            "model": args.to_dict(),
            "weights": dict(sorted(weights.items())),
            "source": {"architectures": config.get("architectures"), "model_type": config.get("model_type")},
        }
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, tmp / name)
        (tmp / CHECKPOINT_JSON).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


STACKED_MIN_PARTS = 4  # a fused tensor of more parts than q/k/v: a mixture of experts' weights stacked


class _Stack:
    """A stacked tensor of `n_parts` parts of one shape (the experts' gate, up or down projections, `models.moe`),
    allocated whole at its first part and each part copied into its rows as it is read."""

    def __init__(self, n_parts: int, first: torch.Tensor) -> None:
        self.rows = first.shape[0]
        self.tensor = torch.empty((n_parts * self.rows, *first.shape[1:]), dtype=first.dtype)
        self.n_parts, self.parts = n_parts, set()

    def add(self, part: int, t: torch.Tensor, *, name: str) -> bool:
        """Copy part `part` in; whether the tensor is complete."""
        if t.shape != (self.rows, *self.tensor.shape[1:]) or t.dtype != self.tensor.dtype:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)} ({t.dtype}); the other experts' have "
                                  f"{(self.rows, *self.tensor.shape[1:])} ({self.tensor.dtype})")
        self.tensor[part * self.rows:(part + 1) * self.rows] = t
        self.parts.add(part)
        return len(self.parts) == self.n_parts


def read_checkpoint_meta(checkpoint_dir: Path) -> dict[str, Any]:
    """`checkpoint.json` of an engine checkpoint, checked for format and version."""
    path = Path(checkpoint_dir) / CHECKPOINT_JSON
    if not path.is_file():
        raise CheckpointNotFoundError(f"{str(checkpoint_dir)!r} is not an engine checkpoint: {path} is missing "
                                      "(run convert_checkpoint first)")
    meta = json.loads(path.read_text())
    if meta.get("format") != CHECKPOINT_FORMAT or meta.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(f"{path}: format={meta.get('format')!r} version={meta.get('format_version')!r}, "
                              f"expected {CHECKPOINT_FORMAT!r} version {CHECKPOINT_FORMAT_VERSION}")
    return meta
