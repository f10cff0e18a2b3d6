"""The architecture's rules, checked: dependencies flow flows -> tasks -> (serving, registry), and every
`serving` module imports inside Triton's python backend with only the standard library, torch and numpy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "serving", "registry")
MAY_IMPORT = {
    "flows": {"flows", "tasks", "serving", "registry"},
    "tasks": {"tasks", "serving", "registry"},
    "serving": {"serving"},
    "registry": {"registry"},
}
NOT_IN_TRITON = ("prefect", "mlflow", "boto3", "pydantic", "transformers", "safetensors", "tokenizers",
                 "tritonclient", "yaml", "fastapi", "matplotlib")


def project_imports(path: Path) -> set[str]:
    """Top-level project packages imported anywhere in the file, lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES}
    return found


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_dependencies_flow_one_way(package):
    wrong = {
        str(path.relative_to(ROOT)): sorted(project_imports(path) - MAY_IMPORT[package])
        for path in modules(package)
        if project_imports(path) - MAY_IMPORT[package]
    }
    assert not wrong, f"{package} may import only {sorted(MAY_IMPORT[package])}: {wrong}"


# The OpenAI-compatible front runs as its own process, never inside Triton.
OWN_PROCESS = ("serving/openai/",)


def test_every_serving_module_imports_with_torch_and_numpy_only():
    names = [
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in modules("serving")
        if not str(p.relative_to(ROOT)).startswith(OWN_PROCESS)
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"bad = sorted(m for m in {NOT_IN_TRITON!r} if m in sys.modules)\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, f"importing serving loaded {done.stdout.strip()} {done.stderr[-2000:]}"
