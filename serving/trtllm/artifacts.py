"""Artifact folders of the TensorRT-LLM kinds, written aside then renamed, with a metadata sidecar.

trtllm-engine::

    engine/                     trtllm-build output: config.json (with "version") + rank<i>.engine
    tokenizer/                  tokenizer files of the source checkpoint (the adapter tokenizes text)
    enginewright-trtllm.json    metadata (written last): kind, limits, options, toolchain, files, fingerprint

trtllm-llmapi::

    checkpoint/                 the HF checkpoint (hardlinked) or ModelOpt's quantized export
    llm_args.json               LLM() keyword arguments, paths relative to the artifact folder
    enginewright-trtllm.json

``fingerprint`` = sha256 of the canonical JSON of the metadata without the ``fingerprint`` key: it covers
limits, options, toolchain and every file's content, and no path or time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.files import link_or_copy
from serving.trtllm.commands import build_command, convert_command, llm_args, modelopt_command
from serving.trtllm.errors import TrtllmArtifactError
from serving.trtllm.options import TrtllmOptions
from serving.trtllm.steps import run_step
from serving.trtllm.toolchain import current_toolchain

METADATA = "enginewright-trtllm.json"
HF_FILES_DIR = "hf_tokenizer"  # tokenizer + config files of the source, kept beside a converted checkpoint
FORMAT = "enginewright-trtllm-artifact"
FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "vocab.json", "merges.txt", "chat_template.jinja")
# Options that do not change the artifact (paths, timeouts) stay out of the metadata and the fingerprint.
NON_CONTENT_OPTIONS = frozenset({"examples_dir", "modelopt_examples_dir", "convert_timeout_s", "build_timeout_s",
                                 "extra"})


@dataclass(frozen=True)
class TrtllmArtifact:
    """What ``read_artifact`` returns; ``path`` and ``fingerprint`` match the torch kind's EngineInfo."""

    path: Path
    kind: str
    fingerprint: str
    limits: dict[str, Any]
    toolchain: dict[str, Any]
    special_tokens: dict[str, Any]
    meta: dict[str, Any]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): _sha256(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != METADATA}


def content_options(options: TrtllmOptions) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(options).items() if k not in NON_CONTENT_OPTIONS}


def special_tokens(hf_dir: Path) -> dict[str, Any]:
    """``end_id`` / ``pad_id`` from generation_config.json or config.json (first id when a list)."""
    found: dict[str, Any] = {}
    for name in ("config.json", "generation_config.json"):  # later files win
        path = Path(hf_dir) / name
        if path.is_file():
            data = json.loads(path.read_text())
            for key, out in (("eos_token_id", "end_id"), ("pad_token_id", "pad_id")):
                value = data.get(key)
                if isinstance(value, list):
                    value = value[0] if value else None
                if value is not None:
                    found[out] = int(value)
    if "end_id" not in found:
        raise TrtllmArtifactError(f"source.checkpoint {hf_dir}: no eos_token_id in config.json or "
                                  "generation_config.json (TensorRT-LLM needs an end id)")
    found.setdefault("pad_id", found["end_id"])
    return found


def _place(src: Path, dst: Path, *, link: bool) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    link_or_copy(src, dst, link=link)


def _copy_tokenizer(hf_dir: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, "config.json"):
        if (Path(hf_dir) / name).is_file():
            shutil.copy2(Path(hf_dir) / name, dst / name)


def _aside(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise TrtllmArtifactError(f"output folder {out_dir} already exists; refusing to overwrite it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def _finish(tmp: Path, out_dir: Path, meta: dict[str, Any]) -> TrtllmArtifact:
    meta = {**meta, "files": _files(tmp)}
    meta["fingerprint"] = hashlib.sha256(_canonical(meta)).hexdigest()
    (tmp / METADATA).write_text(json.dumps(meta, indent=2, sort_keys=True))
    os.rename(tmp, out_dir)
    return read_artifact(out_dir)


def _meta(kind: str, options: TrtllmOptions, toolchain: dict[str, Any], tokens: dict[str, Any],
          commands: list[list[str]]) -> dict[str, Any]:
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind,
        "limits": {"dtype": options.dtype, "max_batch_size": options.max_batch_size,
                   "max_input_len": options.max_input_len, "max_seq_len": options.max_seq_len,
                   "max_num_tokens": options.max_num_tokens},
        "options": content_options(options), "toolchain": toolchain, "special_tokens": tokens,
        # the commands without their machine-specific paths, for the record
        "commands": [[a if not a.startswith("/") else Path(a).name for a in argv] for argv in commands],
    }


def convert_trtllm_checkpoint(hf_dir: Path, out_dir: Path, options: TrtllmOptions, *, log_dir: Path,
                              progress: Callable[[str], None] | None = None,
                              python: str = sys.executable) -> Path:
    """HF checkpoint -> TensorRT-LLM checkpoint (``config.json`` + ``rank<i>.safetensors``) in ``out_dir``."""
    tmp = _aside(out_dir)
    try:
        argv = convert_command(options, Path(hf_dir), tmp, python=python)
        run_step(argv, what="convert_checkpoint" if "--qformat" not in argv else "quantize", progress=progress,
                 log_path=Path(log_dir) / "convert.log", timeout_s=options.convert_timeout_s,
                 setting="engine.trtllm.convert_timeout_s")
        if not (tmp / "config.json").is_file():
            raise TrtllmArtifactError(f"conversion wrote no config.json into {tmp} (log {Path(log_dir) / 'convert.log'})")
        _copy_tokenizer(Path(hf_dir), tmp / HF_FILES_DIR)  # the build needs tokenizer + special tokens
        (tmp / "enginewright-convert.json").write_text(json.dumps(
            {"options": content_options(options), "command": [Path(a).name if a.startswith("/") else a
                                                              for a in argv]}, indent=2, sort_keys=True))
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(out_dir)


def engine_version(engine_dir: Path) -> str | None:
    """The TensorRT-LLM version recorded by ``trtllm-build`` in the engine's ``config.json``."""
    path = Path(engine_dir) / "config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("version")


def build_trtllm_engine(checkpoint_dir: Path, hf_dir: Path, out_dir: Path, options: TrtllmOptions, *,
                        log_dir: Path, progress: Callable[[str], None] | None = None,
                        executable: str = "trtllm-build",
                        toolchain: dict[str, Any] | None = None) -> TrtllmArtifact:
    """``trtllm-build`` the converted checkpoint; the engine folder gets tokenizer files and metadata."""
    tmp = _aside(out_dir)
    try:
        argv = build_command(options, Path(checkpoint_dir), tmp / "engine", executable=executable)
        run_step(argv, what="trtllm-build", progress=progress, log_path=Path(log_dir) / "build.log",
                 timeout_s=options.build_timeout_s, setting="engine.trtllm.build_timeout_s")
        engines = sorted((tmp / "engine").glob("rank*.engine"))
        if not (tmp / "engine" / "config.json").is_file() or len(engines) != options.world_size:
            raise TrtllmArtifactError(
                f"trtllm-build left {tmp / 'engine'} without config.json or with {len(engines)} rank*.engine "
                f"files (expected {options.world_size}); see {Path(log_dir) / 'build.log'}")
        _copy_tokenizer(Path(hf_dir), tmp / "tokenizer")
        tc = dict(toolchain or current_toolchain())
        tc["tensorrt_llm"] = engine_version(tmp / "engine") or tc.get("tensorrt_llm")
        meta = _meta("trtllm-engine", options, tc, special_tokens(Path(hf_dir)), [argv])
        return _finish(tmp, Path(out_dir), meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare_llmapi_artifact(hf_dir: Path, out_dir: Path, options: TrtllmOptions, *, log_dir: Path,
                            progress: Callable[[str], None] | None = None, python: str = sys.executable,
                            toolchain: dict[str, Any] | None = None, link: bool = True) -> TrtllmArtifact:
    """Checkpoint (hardlinked, or quantized by ModelOpt) + ``llm_args.json`` + metadata."""
    hf_dir = Path(hf_dir)
    tmp = _aside(out_dir)
    commands: list[list[str]] = []
    try:
        if not options.llmapi_quantizes_with_modelopt:  # unquantized, or quantized by LLM(quant_config=...)
            for src in sorted(hf_dir.iterdir()):
                if src.is_file():
                    _place(src, tmp / "checkpoint" / src.name, link=link)
        else:
            argv = modelopt_command(options, hf_dir, tmp / "checkpoint", python=python)
            commands.append(argv)
            run_step(argv, what="hf_ptq", progress=progress, log_path=Path(log_dir) / "quantize.log",
                     timeout_s=options.convert_timeout_s, setting="engine.trtllm.convert_timeout_s")
            _copy_tokenizer(hf_dir, tmp / "checkpoint")
        if not (tmp / "checkpoint" / "config.json").is_file():
            raise TrtllmArtifactError(f"{tmp / 'checkpoint'} has no config.json")
        (tmp / "llm_args.json").write_text(json.dumps(llm_args(options), indent=2, sort_keys=True))
        meta = _meta("trtllm-llmapi", options, dict(toolchain or current_toolchain()), special_tokens(hf_dir),
                     commands)
        return _finish(tmp, Path(out_dir), meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_artifact(path: Path) -> TrtllmArtifact:
    """Read the metadata of an artifact folder (no hashing; see ``verify_artifact``)."""
    meta_path = Path(path) / METADATA
    if not meta_path.is_file():
        raise TrtllmArtifactError(f"{path} is not a TensorRT-LLM artifact ({METADATA} missing)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise TrtllmArtifactError(f"{meta_path}: format {meta.get('format')!r} v{meta.get('format_version')} "
                                  f"is not {FORMAT} v{FORMAT_VERSION}")
    return TrtllmArtifact(Path(path), meta["kind"], meta["fingerprint"], meta["limits"], meta["toolchain"],
                          meta.get("special_tokens", {}), meta)


def verify_artifact(path: Path) -> TrtllmArtifact:
    """Recompute every file hash and the fingerprint; raise ``TrtllmArtifactError`` on any difference."""
    art = read_artifact(path)
    files = _files(Path(path))
    if files != art.meta["files"]:
        changed = sorted(set(files.items()) ^ set(art.meta["files"].items()))
        raise TrtllmArtifactError(f"artifact {path} changed since it was built: {[c[0] for c in changed][:5]}")
    body = {k: v for k, v in art.meta.items() if k != "fingerprint"}
    if hashlib.sha256(_canonical(body)).hexdigest() != art.fingerprint:
        raise TrtllmArtifactError(f"artifact {path}: fingerprint does not match its metadata")
    return art
