"""Locate the tritonserver bundled in the nvidia-pytriton wheel and prepare its backends and environment.

The wheel ships ``pytriton/tritonserver/{bin,backends,python_backend_stubs}`` and its shared libraries in
``<site-packages>/nvidia_pytriton.libs``. The python backend needs ``libtriton_python.so``,
``triton_python_backend_utils.py`` and the stub built for *this* interpreter's X.Y in one folder; the stub
links ``libpython3.X.so`` by name, so the interpreter's own libdir must come first on LD_LIBRARY_PATH, and
it finds the venv through the first ``python3`` on PATH (it ignores PYTHONPATH/PYTHONHOME).
pytriton itself is never imported (it pulls in heavy dependencies); only its location is looked up.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from serving.triton.errors import TritonNotInstalledError

PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
STUB_NAME = "triton_python_backend_stub"


@dataclass(frozen=True)
class TritonInstall:
    """Where the bundled server lives and how to run it."""

    server_bin: Path
    backends_dir: Path
    env: dict[str, str] = field(repr=False)
    python_version: str


def find_pytriton_dir() -> Path:
    """Return ``<site-packages>/pytriton/tritonserver`` without importing pytriton."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonNotInstalledError(
            "package 'pytriton' not found for interpreter "
            f"{sys.executable} (dependency nvidia-pytriton==0.7.0 in pyproject.toml); "
            "run `make .venv/.installed`"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise TritonNotInstalledError(f"no tritonserver binary at {root / 'bin' / 'tritonserver'} (nvidia-pytriton)")
    return root


def python_libdir() -> Path:
    """The directory holding this interpreter's shared ``libpython3.X.so``."""
    return Path(sysconfig.get_config_var("LIBDIR") or Path(sys.base_prefix) / "lib")


def pytriton_libs_dir(tritonserver_dir: Path) -> Path:
    """``<site-packages>/nvidia_pytriton.libs`` (the wheel's vendored shared libraries)."""
    return tritonserver_dir.parent.parent / "nvidia_pytriton.libs"


def _copy_if_changed(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` atomically (temp file + rename) unless an identical-size copy exists."""
    if dst.is_file() and dst.stat().st_size == src.stat().st_size:
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def prepare_backends(dest: Path | None = None, *, tritonserver_dir: Path | None = None) -> Path:
    """Build ``<dest>/python/`` with the python backend and the stub matching this interpreter."""
    src_root = tritonserver_dir or find_pytriton_dir()
    xy = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = src_root / "python_backend_stubs" / xy / STUB_NAME
    if not stub.is_file():
        available = sorted(p.name for p in (src_root / "python_backend_stubs").glob("*"))
        raise TritonNotInstalledError(
            f"no python backend stub for Python {xy} in {stub.parent.parent} (available: {available})"
        )
    dest = dest or Path(tempfile.gettempdir()) / f"enginewright-triton-{os.getuid()}" / "backends"
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in PYTHON_BACKEND_FILES:
        src = src_root / "backends" / "python" / name
        if not src.is_file():
            raise TritonNotInstalledError(f"python backend file {src} missing from nvidia-pytriton")
        _copy_if_changed(src, python_dir / name)
    _copy_if_changed(stub, python_dir / STUB_NAME)
    os.chmod(python_dir / STUB_NAME, 0o755)
    return dest


def triton_env(tritonserver_dir: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: interpreter libdir first, then the wheel's libs; venv bin first on PATH."""
    env = dict(os.environ if base is None else base)
    lib_path = [str(python_libdir()), str(pytriton_libs_dir(tritonserver_dir))]
    if env.get("LD_LIBRARY_PATH"):
        lib_path.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_path)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "/usr/bin:/bin")])
    return env


def locate_triton(backends_dir: Path | None = None) -> TritonInstall:
    """Find the bundled server, prepare its backends folder and environment."""
    root = find_pytriton_dir()
    return TritonInstall(
        server_bin=root / "bin" / "tritonserver",
        backends_dir=prepare_backends(backends_dir, tritonserver_dir=root),
        env=triton_env(root),
        python_version=f"{sys.version_info.major}.{sys.version_info.minor}",
    )
