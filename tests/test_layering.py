"""The architecture's rules, checked: dependencies flow flows -> tasks -> (serving, registry), no module
takes part in an import cycle, every `serving` module imports inside Triton's python backend with
only the standard library, torch and numpy, and the lab (`bench/`) stays out of the product: never imported
by it, never shipped with it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from setuptools import find_namespace_packages

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "serving", "registry")
LAB = "bench"  # benchmarks, sweeps and device scripts: may import the product, never imported by it
MAY_IMPORT = {
    "flows": {"flows", "tasks", "serving", "registry"},
    "tasks": {"tasks", "serving", "registry"},
    "serving": {"serving"},
    "registry": {"registry"},
}
NOT_IN_TRITON = ("prefect", "mlflow", "boto3", "pydantic", "transformers", "safetensors", "tokenizers",
                 "tritonclient", "yaml", "fastapi", "matplotlib")


def project_imports(path: Path) -> set[str]:
    """Top-level project packages (the lab included) imported anywhere in the file, lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in (*PACKAGES, LAB)}
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


def test_the_product_importing_the_lab_is_refused(tmp_path):
    """The rule above sees the lab: a product module that imports `bench`, even lazily, breaks it."""
    module = tmp_path / "perf.py"
    module.write_text("import torch\n\ndef once():\n    from bench.offline import run_offline\n    import bench\n")
    for package in PACKAGES:
        assert project_imports(module) - MAY_IMPORT[package] == {LAB}


def test_the_package_ships_without_the_lab_and_the_tests():
    """`pip install` gets the product only: `packages.find` of pyproject.toml, as setuptools applies it."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = set(find_namespace_packages(where=str(ROOT), include=find["include"]))
    assert {"flows", "tasks", "serving", "serving.engine", "registry"} <= shipped
    assert not {p for p in shipped if p.split(".")[0] not in PACKAGES}, sorted(shipped)


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules one file imports, at the top or inside functions: `from a.b import c` names the
    module `a.b.c` when there is one, else `a.b`; a name with no module of its own counts as its package."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != here:
                found.add(name)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(members) > 1:
                        cycles.append(sorted(members))
            elif step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                work.append((step, iter(sorted(graph[step]))))
            elif step in stack:
                low[node] = min(low[node], index[step])
    return cycles


def project_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for package in PACKAGES for p in modules(package)}
    return {name: imported_modules(path, set(paths)) for name, path in paths.items()}


def test_import_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_no_module_takes_part_in_an_import_cycle():
    """Lazy imports count too: a circle hidden inside a function is still a circle (move the shared piece down)."""
    cycles = import_cycles(project_graph())
    assert not cycles, f"modules that import each other (directly or around a circle): {cycles}"


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


# Every CLI command that takes a release spec reads it first (flows.run -> flows.spec): the gates' settings live apart
# from the gates (tasks.gate_specs), so reading a spec, or a promote stopped while it waits for a person, costs no
# torch, Prefect or MLflow import (about 5 s of CPU per CLI process on the 2-core machine).
HEAVY_FOR_A_SPEC = ("torch", "prefect", "mlflow", "transformers", "serving.engine")


def test_reading_a_release_spec_imports_no_engine_prefect_or_mlflow():
    code = (
        "import sys, flows.run\n"
        f"print(sorted(m for m in {HEAVY_FOR_A_SPEC!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.strip() == "[]", f"importing flows.run (flows.spec) loaded {done.stdout.strip()}"


def test_a_command_stopped_while_waiting_exits_without_importing_the_engine():
    """Ctrl-C or SIGTERM during the approval wait ends the command at once: the exit path loads nothing
    (the spec-only promote has not imported torch; catching the signal's exception after `known_errors()`
    did, 3.5 s on the idle 2-core machine and past the 5 s a stopped promote is given under CI's load)."""
    code = (
        "import argparse, os, signal, sys\n"
        "import flows.cli as cli\n"
        "from flows.interrupt import WaitInterrupted\n"
        "def stopped(_args): raise WaitInterrupted(signal.SIGTERM, 'the approval')\n"
        "class Parser:\n"
        "    def parse_args(self, argv): return argparse.Namespace(func=stopped, command='promote')\n"
        "cli.build_parser = Parser\n"
        "os._exit = lambda code: (print(code, sorted(m for m in ('torch', 'serving.engine') if m in sys.modules)),"
        " sys.exit(0))\n"
        "cli.main([])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.split("\n")[0] == "143 []", done.stdout + done.stderr


def test_the_approval_wait_imports_no_prefect():
    """A promote waits for its approval before its flow run: the wait's module loads no Prefect (4 s of CPU
    of the 15 s a waiting promote took to print its link on the 2-core machine)."""
    code = "import sys, tasks.approve\nprint(sorted(m for m in ('prefect', 'torch') if m in sys.modules))\n"
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout
