"""Engine checkpoint -> engine folder: limits, toolchain record, content fingerprint, atomic write.

An engine folder is self-contained:

    engine.json                 format, model args, limits, quantization, KV-cache settings, toolchain,
                                sha256 of every file, fingerprint
    weights-0000i-of-0000N.pt   torch.save'd tensor dicts (load with torch alone, mmap)
    tokenizer.json, ...         tokenizer files copied from the checkpoint

`fingerprint` = sha256 of the canonical JSON (sorted keys, no spaces) of engine.json without the
`fingerprint` key; since engine.json lists the sha256 of every other file, it covers the weights.
The folder is written aside and renamed; an existing identical engine is returned as is, an
existing different one is refused.

Toolchain policy (`check_toolchain`):
- the engine format version must be the runtime's;
- torch major version must match, always (the weight format is torch's);
- an engine built where a GPU was present (compute capability recorded) and loaded on CUDA must
  match that compute capability, torch major.minor and CUDA major: later releases attach
  compiled/captured artifacts that are only valid there;
- an engine built on CPU ("cpu") loads on any device with the same torch major.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from serving.engine.convert import DTYPES, TOKENIZER_FILES, read_checkpoint_meta
from serving.engine.errors import (
    CheckpointNotFoundError,
    EngineExistsError,
    EngineFormatError,
    EngineIntegrityError,
    EngineLimitError,
    ToolchainMismatchError,
)
from serving.engine.kv_cache import KVCacheConfig, check_kv_cache_config, kv_block_bytes, kv_element_bytes
from serving.engine.model import ModelArgs
from serving.engine.models.registry import registered
from serving.engine.parallel import check_tensor_parallel
from serving.engine.quantize import QuantInfo, check_capability_text

ENGINE_FORMAT = "enginewright-torch-engine"
ENGINE_FORMAT_VERSION = 1
ENGINE_JSON = "engine.json"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class EngineLimits:
    """What an engine accepts: weight/activation dtype, batch size, prompt and total sequence length."""

    dtype: str  # "float32" | "bfloat16" | "float16"
    max_batch_size: int
    max_input_len: int
    max_seq_len: int

    def validate(self, model: ModelArgs) -> None:
        """Raise EngineLimitError naming the value and the limit when the limits are inconsistent."""
        if self.dtype not in DTYPES:
            raise EngineLimitError(f"limits.dtype={self.dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        for name in ("max_batch_size", "max_input_len", "max_seq_len"):
            if getattr(self, name) < 1:
                raise EngineLimitError(f"limits.{name}={getattr(self, name)} must be >= 1")
        if self.max_input_len >= self.max_seq_len:
            raise EngineLimitError(f"limits.max_input_len={self.max_input_len} must be < "
                                   f"limits.max_seq_len={self.max_seq_len}")
        if model.rope_type == "longrope" and self.max_seq_len > model.rope_original_max_position_embeddings:
            raise EngineLimitError(f"limits.max_seq_len={self.max_seq_len} exceeds the model's "
                                   f"original_max_position_embeddings={model.rope_original_max_position_embeddings} "
                                   "(rope type 'longrope': the engine applies its short factors, which HF uses up to "
                                   "that length; its long factors are not supported)")
        if self.max_seq_len > model.max_position_embeddings:
            raise EngineLimitError(f"limits.max_seq_len={self.max_seq_len} exceeds the model's "
                                   f"max_position_embeddings={model.max_position_embeddings}")


@dataclass(frozen=True)
class EngineInfo:
    """What `engine.json` says about an engine folder."""

    fingerprint: str
    toolchain: dict[str, Any]
    limits: EngineLimits
    model: ModelArgs
    path: Path
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    quantization: QuantInfo = field(default_factory=QuantInfo)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)  # the paged KV cache's settings
    tensor_parallel: int = 1  # ranks (GPUs) the engine runs on, each with its shard (`serving.engine.parallel`)

    @property
    def weight_files(self) -> list[str]:
        return sorted(f for f in self.files if f.endswith(".pt"))


# ---------------------------------------------------------------------------------------------
# toolchain


def current_toolchain(device: torch.device | str | None = None) -> dict[str, Any]:
    """torch/CUDA versions and the compute capability of `device` (default: GPU 0 if any, else "cpu")."""
    dev = torch.device(device) if device is not None else None
    if dev is None and torch.cuda.is_available():
        dev = torch.device("cuda", 0)
    if dev is not None and dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        capability = f"{major}.{minor}"
    else:
        capability = "cpu"
    return {
        "torch": torch.__version__.split("+")[0],
        "cuda": torch.version.cuda,
        "compute_capability": capability,
        "engine_format_version": ENGINE_FORMAT_VERSION,
    }


def _major_minor(version: str | None) -> tuple[int, ...]:
    m = re.match(r"(\d+)(?:\.(\d+))?", version or "")
    return (int(m.group(1)), int(m.group(2) or 0)) if m else ()


def check_toolchain(info: EngineInfo, *, device: torch.device | str) -> None:
    """Raise ToolchainMismatchError (naming both sides) if `info`'s engine cannot run on `device` here."""
    built, here = info.toolchain, current_toolchain(device)
    where = f"engine {str(info.path)!r}"
    if built.get("engine_format_version") != here["engine_format_version"]:
        raise ToolchainMismatchError(f"{where} has engine format version {built.get('engine_format_version')}, "
                                     f"this runtime reads version {here['engine_format_version']}")
    b_torch, h_torch = _major_minor(built.get("torch")), _major_minor(here["torch"])
    if b_torch[:1] != h_torch[:1]:
        raise ToolchainMismatchError(f"{where} was built with torch {built.get('torch')}, runtime has torch "
                                     f"{here['torch']}: torch major versions must match")
    if torch.device(device).type != "cuda" or built.get("compute_capability") == "cpu":
        return
    if built.get("compute_capability") != here["compute_capability"]:
        raise ToolchainMismatchError(f"{where} was built for compute capability {built.get('compute_capability')}, "
                                     f"runtime device {device} has {here['compute_capability']}")
    if b_torch != h_torch:
        raise ToolchainMismatchError(f"{where} (GPU engine) was built with torch {built.get('torch')}, runtime has "
                                     f"torch {here['torch']}: major.minor must match for GPU engines")
    if _major_minor(built.get("cuda"))[:1] != _major_minor(here["cuda"])[:1]:
        raise ToolchainMismatchError(f"{where} (GPU engine) was built with CUDA {built.get('cuda')}, runtime has "
                                     f"CUDA {here['cuda']}: CUDA major versions must match")


# ---------------------------------------------------------------------------------------------
# fingerprint and files


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def compute_fingerprint(engine_json: dict[str, Any]) -> str:
    """sha256 of the canonical engine.json without its `fingerprint` key (which lists file hashes)."""
    body = {k: v for k, v in engine_json.items() if k != "fingerprint"}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def _copy_hashing(src: Path, dst: Path) -> str:
    """Copy src to dst in chunks, returning the sha256 of the bytes."""
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# build / read


def build_engine(checkpoint_dir: Path, out_dir: Path, *, limits: EngineLimits,
                 quantization: QuantInfo | None = None, kv_cache: KVCacheConfig | None = None,
                 tensor_parallel: int = 1) -> EngineInfo:
    """Write the engine folder `out_dir` from an engine checkpoint; idempotent for identical inputs.
    `quantization`, when given, must be what the checkpoint was converted with; `kv_cache` (default:
    `KVCacheConfig()`) is checked against the limits and recorded; `tensor_parallel` (recorded when > 1) must
    divide the heads (`parallel.check_tensor_parallel`); the weights stay whole, each rank's loader slices its
    shard (`parallel_shard`)."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    meta = read_checkpoint_meta(checkpoint_dir)
    model = ModelArgs.from_dict(meta["model"])
    limits.validate(model)
    check_tensor_parallel(model, tensor_parallel)
    if tensor_parallel > 1 and not registered(model.architecture).tensor_parallel:
        raise EngineLimitError(f"tensor_parallel={tensor_parallel}: architecture {model.architecture!r} is served "
                               "with tensor_parallel 1 only (its layers have no sharding)")
    kv_cache = kv_cache or KVCacheConfig()
    check_kv_cache_config(kv_cache, max_seq_len=limits.max_seq_len, max_batch_size=limits.max_batch_size,
                          block_bytes=kv_block_bytes(n_layers=model.n_layers, n_kv_heads=model.n_kv_heads,
                                                     head_dim=model.head_dim, block_size=max(kv_cache.block_size, 1),
                                                     element_bytes=kv_element_bytes(kv_cache.kv_cache_dtype,
                                                                                    DTYPES[limits.dtype].itemsize)))
    if limits.dtype != meta["dtype"]:
        raise EngineLimitError(f"limits.dtype={limits.dtype!r} but checkpoint {str(checkpoint_dir)!r} was "
                               f"converted to dtype={meta['dtype']!r}; convert with dtype={limits.dtype!r}")
    converted = QuantInfo.from_dict(meta.get("quantization"))
    if quantization is not None and quantization != converted:
        raise EngineLimitError(f"engine.quantization={quantization.method!r} (lm head {quantization.lm_head}) but "
                               f"checkpoint {str(checkpoint_dir)!r} was converted with {converted.method!r} (lm head "
                               f"{converted.lm_head}); convert with the same quantization")
    quantization = converted
    toolchain = current_toolchain()
    check_capability_text(quantization.method, toolchain["compute_capability"],
                          where=f"build of {str(checkpoint_dir)!r}")
    weight_files = sorted(set(meta["weights"].values()))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files: dict[str, str] = {}
        for name in weight_files + [t for t in TOKENIZER_FILES if (checkpoint_dir / t).is_file()]:
            src = checkpoint_dir / name
            if not src.is_file():
                raise CheckpointNotFoundError(f"checkpoint file {src} listed in checkpoint.json is missing")
            files[name] = _copy_hashing(src, tmp / name)
        engine_json: dict[str, Any] = {
            "format": ENGINE_FORMAT,
            "format_version": ENGINE_FORMAT_VERSION,
            "kind": "torch",
            "model": model.to_dict(),
            "limits": dataclasses.asdict(limits),
            "toolchain": toolchain,
            "files": files,
            "kv_cache": kv_cache.to_dict(),
        }
        if quantization.enabled:  # (absent for unquantized engines: their fingerprints stay as they were)
            engine_json["quantization"] = meta["quantization"]
        if tensor_parallel > 1:  # (absent for one rank, likewise)
            engine_json["tensor_parallel"] = tensor_parallel
        engine_json["fingerprint"] = compute_fingerprint(engine_json)
        (tmp / ENGINE_JSON).write_text(json.dumps(engine_json, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            _refuse_different(out_dir, engine_json["fingerprint"])
            shutil.rmtree(tmp)
            return read_engine_info(out_dir)
        try:
            os.rename(tmp, out_dir)
        except OSError:  # someone else finished the same folder first
            _refuse_different(out_dir, engine_json["fingerprint"])
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return read_engine_info(out_dir)


def _refuse_different(out_dir: Path, fingerprint: str) -> None:
    try:
        existing = read_engine_info(out_dir).fingerprint
    except (CheckpointNotFoundError, EngineFormatError) as e:
        raise EngineExistsError(f"build output {str(out_dir)!r} exists and is not an engine ({e}); "
                                "remove it or pick another folder") from None
    if existing != fingerprint:
        raise EngineExistsError(f"build output {str(out_dir)!r} holds a different engine (fingerprint "
                                f"{existing[:12]}, new build {fingerprint[:12]}); refusing to overwrite it")


def read_engine_info(engine_dir: Path) -> EngineInfo:
    """Parse `engine.json` of an engine folder (no file hashing; see `verify_engine`)."""
    engine_dir = Path(engine_dir)
    path = engine_dir / ENGINE_JSON
    if not path.is_file():
        raise CheckpointNotFoundError(f"{str(engine_dir)!r} is not an engine folder: {path} is missing")
    try:
        d = json.loads(path.read_text())
        if d.get("format") != ENGINE_FORMAT or d.get("format_version") != ENGINE_FORMAT_VERSION:
            raise EngineFormatError(f"{path}: format={d.get('format')!r} version={d.get('format_version')!r}, "
                                    f"expected {ENGINE_FORMAT!r} version {ENGINE_FORMAT_VERSION}")
        return EngineInfo(
            fingerprint=d["fingerprint"],
            toolchain=d["toolchain"],
            limits=EngineLimits(**d["limits"]),
            model=ModelArgs.from_dict(d["model"]),
            path=engine_dir,
            files=d["files"],
            quantization=QuantInfo.from_dict(d.get("quantization")),
            kv_cache=_kv_cache_record(d),
            tensor_parallel=int(d.get("tensor_parallel", 1)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise EngineFormatError(f"{path} is malformed: {e!r}") from None


def _kv_cache_record(d: dict[str, Any]) -> KVCacheConfig:
    """engine.json's `kv_cache`; an engine built by an earlier release has `paged` (the same settings) or
    neither (a static cache: the pool then has the room of that cache, `kv_cache.static_pool_blocks`)."""
    if "kv_cache" in d:
        return KVCacheConfig.from_dict(d["kv_cache"])
    if d.get("paged"):
        return KVCacheConfig.from_dict(d["paged"], setting="paged")
    return KVCacheConfig()


def verify_engine(engine_dir: Path) -> EngineInfo:
    """read_engine_info + recompute the fingerprint and every file's sha256; EngineIntegrityError on mismatch."""
    info = read_engine_info(engine_dir)
    d = json.loads((Path(engine_dir) / ENGINE_JSON).read_text())
    if compute_fingerprint(d) != info.fingerprint:
        raise EngineIntegrityError(f"{engine_dir}/{ENGINE_JSON}: fingerprint {info.fingerprint[:12]} does not match "
                                   f"its content ({compute_fingerprint(d)[:12]})")
    for name, expected in info.files.items():
        actual = sha256_file(Path(engine_dir) / name)
        if actual != expected:
            raise EngineIntegrityError(f"{engine_dir}/{name}: sha256 {actual[:12]} != recorded {expected[:12]}")
    return info
