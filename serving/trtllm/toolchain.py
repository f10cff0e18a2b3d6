"""The TensorRT-LLM toolchain: is it installed, what versions are here, and may an artifact run on it.

Nothing here imports ``tensorrt_llm`` (importing it initialises CUDA and MPI): versions come from
package metadata, NGC container environment variables and ``nvidia-smi``.

Policy (``check_trtllm_toolchain``), the most reported TensorRT-LLM deployment failure being version
skew between the build and serve containers:

- ``trtllm-engine`` (serialized TensorRT engines): the GPU compute capability and the TensorRT-LLM
  version must be equal on both sides; the TensorRT version too when both sides know it.
- ``trtllm-llmapi`` (checkpoint + ``LLM()`` arguments): TensorRT-LLM major.minor must be equal (the
  argument schema changes between minors); the compute capability must be at least 8.9 when the
  artifact uses FP8 (weights or KV cache), which is what Ada/Hopper provide.
- A field the recorded side needs but the target side does not know is an error too: the check must
  be able to say yes, not guess.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from typing import Any

from serving.trtllm.errors import TrtllmToolchainMismatchError, TrtllmUnavailableError

ENGINE_KINDS = ("trtllm-engine", "trtllm-llmapi")
# Environment variables that NGC containers (or the operator) set; the first one present wins.
TRTLLM_VERSION_ENV = ("TENSORRT_LLM_VERSION", "TRTLLM_VERSION", "TRT_LLM_VERSION")
TENSORRT_VERSION_ENV = ("TRT_VERSION", "TENSORRT_VERSION")
IMAGE_ENV = "ENGINEWRIGHT_CONTAINER_IMAGE"
TRITON_CONTAINER_ENV = "NVIDIA_TRITON_SERVER_VERSION"  # e.g. "25.10" inside nvcr.io/nvidia/tritonserver
FP8_MIN_CC = (8, 9)


def trtllm_installed() -> bool:
    """True when the ``tensorrt_llm`` package can be imported here (it is not imported)."""
    try:
        return importlib.util.find_spec("tensorrt_llm") is not None
    except (ImportError, ValueError):
        return False


def require_trtllm(kind: str, *, setting: str = "engine.kind", commands: tuple[str, ...] = ()) -> None:
    """Fail early, naming ``setting``, when TensorRT-LLM (or one of ``commands``) is missing here."""
    missing = [] if trtllm_installed() else ["the python package tensorrt_llm"]
    missing += [f"the command {c!r} on PATH" for c in commands if shutil.which(c) is None]
    if missing:
        raise TrtllmUnavailableError(
            f"{setting}={kind!r} needs TensorRT-LLM, but {' and '.join(missing)} is missing on this machine. "
            "TensorRT-LLM is not installable from PyPI (its entry there is a stub): run this step inside "
            "nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 (or NVIDIA's own package index), "
            f"or set {setting}: torch"
        )


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _env_first(names: tuple[str, ...]) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def gpu_compute_capability() -> str | None:
    """Compute capability of GPU 0 ("9.0"), from ``nvidia-smi``; None without a GPU or driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[0].strip() if out.strip() else ""
    return first or None


def container_image() -> str | None:
    """The serving/build image if known: ``ENGINEWRIGHT_CONTAINER_IMAGE``, else the NGC Triton tag."""
    if os.environ.get(IMAGE_ENV):
        return os.environ[IMAGE_ENV]
    tag = os.environ.get(TRITON_CONTAINER_ENV)
    return f"nvcr.io/nvidia/tritonserver:{tag}-trtllm-python-py3" if tag else None


def current_toolchain() -> dict[str, Any]:
    """What this machine runs: TensorRT-LLM, TensorRT, CUDA versions, image, GPU compute capability."""
    return {
        "tensorrt_llm": _package_version("tensorrt_llm") or _package_version("tensorrt-llm")
        or _env_first(TRTLLM_VERSION_ENV),
        "tensorrt": _package_version("tensorrt") or _env_first(TENSORRT_VERSION_ENV),
        "cuda": os.environ.get("CUDA_VERSION"),
        "container_image": container_image(),
        "compute_capability": gpu_compute_capability(),
    }


def _cc_tuple(cc: str) -> tuple[int, int]:
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def _major_minor(version: str) -> str:
    return ".".join(str(version).split(".")[:2])


def _describe(side: dict[str, Any]) -> str:
    parts = [f"tensorrt_llm {side.get('tensorrt_llm') or 'unknown'}",
             f"compute capability {side.get('compute_capability') or 'unknown'}"]
    if side.get("tensorrt"):
        parts.append(f"TensorRT {side['tensorrt']}")
    if side.get("container_image"):
        parts.append(f"image {side['container_image']}")
    return ", ".join(parts)


def check_trtllm_toolchain(recorded: dict[str, Any], current: dict[str, Any], *, kind: str = "trtllm-engine",
                           uses_fp8: bool = False, setting: str = "engine.trtllm.target_toolchain") -> None:
    """Raise ``TrtllmToolchainMismatchError`` naming both sides when ``recorded`` cannot run on ``current``.

    ``recorded`` is the toolchain an artifact was built with (its metadata); ``current`` the target's
    (detected with ``current_toolchain()`` or given by ``setting``).
    """
    if kind not in ENGINE_KINDS:
        raise ValueError(f"kind={kind!r} is not a TensorRT-LLM engine kind ({', '.join(ENGINE_KINDS)})")
    problems: list[str] = []
    rec_v, cur_v = recorded.get("tensorrt_llm"), current.get("tensorrt_llm")
    rec_cc, cur_cc = recorded.get("compute_capability"), current.get("compute_capability")
    if not rec_v:
        problems.append("the artifact records no tensorrt_llm version")
    elif not cur_v:
        problems.append(f"the target's tensorrt_llm version is unknown (set {setting}.tensorrt_llm)")
    elif kind == "trtllm-engine" and rec_v != cur_v:
        problems.append(f"TensorRT-LLM version differs: built with {rec_v}, target has {cur_v}")
    elif kind == "trtllm-llmapi" and _major_minor(rec_v) != _major_minor(cur_v):
        problems.append(f"TensorRT-LLM major.minor differs: built with {rec_v}, target has {cur_v}")
    if kind == "trtllm-engine":
        if not rec_cc:
            problems.append("the engine records no compute capability")
        elif not cur_cc:
            problems.append(f"the target's compute capability is unknown (set {setting}.compute_capability)")
        elif _cc_tuple(rec_cc) != _cc_tuple(cur_cc):
            problems.append(f"compute capability differs: engine built for {rec_cc}, target GPU is {cur_cc} "
                            "(TensorRT engines are specific to one GPU architecture)")
        rec_trt, cur_trt = recorded.get("tensorrt"), current.get("tensorrt")
        if rec_trt and cur_trt and rec_trt != cur_trt:
            problems.append(f"TensorRT version differs: built with {rec_trt}, target has {cur_trt}")
    elif uses_fp8:
        if not cur_cc:
            problems.append(f"the target's compute capability is unknown (set {setting}.compute_capability)")
        elif _cc_tuple(cur_cc) < FP8_MIN_CC:
            problems.append(f"FP8 needs compute capability >= 8.9, target GPU is {cur_cc}")
    if problems:
        raise TrtllmToolchainMismatchError(
            f"{kind} artifact cannot be served on this target: " + "; ".join(problems)
            + f". Recorded: {_describe(recorded)}. Target: {_describe(current)}."
        )
