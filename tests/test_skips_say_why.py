"""No test is skipped without a reason that `pytest -ra` (the default addopts) prints: every `pytest.skip`,
`pytest.mark.skip` and `pytest.mark.skipif` in tests/ carries a non-empty reason. `pytest.importorskip`
needs none: pytest prints the import error it got."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def dotted(node: ast.expr) -> str:
    """`pytest.mark.skipif` for the attribute chain of a call's function; "" for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def says_why(reason: ast.expr | None) -> bool:
    """A reason is there unless it is missing or an empty literal (an f-string or a name counts)."""
    if reason is None:
        return False
    return not (isinstance(reason, ast.Constant) and not str(reason.value or "").strip())


def skips_without_reason(source: str) -> list[int]:
    """Line numbers of the skips in `source` that give no reason."""
    tree = ast.parse(source)
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    bare = []
    for node in ast.walk(tree):
        name = dotted(node.func) if isinstance(node, ast.Call) else (dotted(node) if isinstance(node, ast.Attribute) else "")
        if name in ("pytest.mark.skip", "pytest.mark.skipif") and isinstance(node, ast.Attribute):
            if id(node) not in called:  # a bare decorator or mark, never called with a reason
                bare.append(node.lineno)
            continue
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        if name == "pytest.skip":
            reason = node.args[0] if node.args else keywords.get("reason", keywords.get("msg"))
        elif name == "pytest.mark.skip":
            reason = node.args[0] if node.args else keywords.get("reason")
        elif name == "pytest.mark.skipif":
            reason = keywords.get("reason")
        else:
            continue
        if not says_why(reason):
            bare.append(node.lineno)
    return sorted(bare)


def test_a_skip_without_a_reason_is_found():
    source = (
        "import pytest\n"
        "@pytest.mark.skipif(True)\n"
        "def test_a(): pytest.skip()\n"
        "@pytest.mark.skip\n"
        "def test_b(): pytest.skip('')\n"
        "@pytest.mark.skipif(True, reason='needs CUDA')\n"
        "def test_c(): pytest.skip(f'{1} row')\n"
    )
    assert skips_without_reason(source) == [2, 3, 4, 5]


def test_every_skip_in_the_tests_says_why():
    bare = {
        str(path.relative_to(TESTS)): lines
        for path in sorted(TESTS.rglob("*.py"))
        if (lines := skips_without_reason(path.read_text()))
    }
    assert not bare, f"skips without a reason (give `reason=`, so `pytest -ra` prints why): {bare}"
