"""docs/architecture.md names the function for each step of a request and of a release; this keeps it true.

Every backticked code name in the page must exist: a dotted name (`tasks.stage.stage`, `step.build_step`,
`EngineRunner.forward`) resolves, tried as written and under each package of the project; a backticked call
(`build_engine(checkpoint_dir, out_dir, *, limits: EngineLimits, ...)`) must have the function's parameters in
order, with the same keyword-only marker and the defaults the page states; a backticked `*.py` path exists.
Spans that are not code names (file names inside engine folders, config keys, aliases) are told apart by shape:
a name with a `<`, `/`, `:`-less URL or a file suffix other than `.py`."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
# where a short dotted name is looked up, in order (the page writes `step.build_step` for serving.engine.step)
PACKAGES = ("", "serving.", "serving.engine.", "serving.engine.runner.", "serving.engine.models.", "tasks.",
            "registry.", "flows.", "serving.triton.", "serving.triton.models.", "serving.openai.",
            "serving.openai.backend.")
PATH_FOLDERS = ("", "serving/engine/", "serving/triton/", "serving/triton/models/", "tasks/", "flows/", "registry/")
CALL = re.compile(r"^([A-Za-z_][\w.:]*)\((.*)\)(\s*->\s*.+)?$", re.DOTALL)
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
NOT_CODE_SUFFIXES = (".json", ".pbtxt", ".md", ".yaml", ".py")  # a .py is a file: checked below


def spans() -> list[str]:
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", PAGE.read_text())]


def resolve(name: str) -> Any:
    """The object `name` names (`a.b:c` as `a.b.c`), under the first package prefix where it exists."""
    dotted = name.replace(":", ".")
    for prefix in PACKAGES:
        parts = (prefix + dotted).split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj: Any = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                break
            return obj
    raise LookupError(name)


def documented_parameters(text: str) -> list[tuple[str, str | None]]:
    """`a, *, b: T, c=None, **kw` -> [("a", None), ("*", None), ("b", None), ("c", "None"), ("**kw", None)]."""
    tree = ast.parse(f"def f({text}): pass").body[0].args
    out: list[tuple[str, str | None]] = []
    positional = tree.posonlyargs + tree.args
    defaults = [None] * (len(positional) - len(tree.defaults)) + [ast.unparse(d) for d in tree.defaults]
    out += [(a.arg, d) for a, d in zip(positional, defaults)]
    if tree.vararg:
        out.append(("*" + tree.vararg.arg, None))
    elif tree.kwonlyargs:
        out.append(("*", None))
    out += [(a.arg, ast.unparse(d) if d is not None else None) for a, d in zip(tree.kwonlyargs, tree.kw_defaults)]
    if tree.kwarg:
        out.append(("**" + tree.kwarg.arg, None))
    return out


def code_parameters(fn: Any) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    star = False
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.VAR_POSITIONAL:
            out.append(("*" + p.name, None))
            star = True
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append(("*", None))
            star = True
        if p.kind is p.VAR_KEYWORD:
            out.append(("**" + p.name, None))
            continue
        out.append((p.name, None if p.default is p.empty else repr(p.default)))
    return out


def same_default(documented: str | None, code: str | None) -> bool:
    if documented is None:
        return True  # the page need not state a default
    try:
        return code is not None and ast.literal_eval(documented) == ast.literal_eval(code)
    except ValueError:
        return documented == code


def signature_mismatch(call: str) -> str | None:
    match = CALL.match(call)
    assert match, call
    name, params = match.group(1), match.group(2)
    documented = documented_parameters(params)
    code = code_parameters(resolve(name))
    names_doc, names_code = [n for n, _ in documented], [n for n, _ in code]
    if names_doc != names_code:
        return f"{name}: page {names_doc}, code {names_code}"
    wrong = [n for (n, d), (_, c) in zip(documented, code) if not same_default(d, c)]
    return f"{name}: defaults of {wrong} differ" if wrong else None


def is_code_name(span: str) -> bool:
    return bool(DOTTED.match(span)) and not span.endswith(NOT_CODE_SUFFIXES)


def test_the_page_names_calls_and_modules():
    """The check below can fail: it finds the page's calls and names, and an invented one is caught."""
    found = spans()
    assert sum(bool(CALL.match(s)) for s in found) >= 8
    assert sum(is_code_name(s) for s in found) >= 40
    with pytest.raises(LookupError):
        resolve("tasks.stage.no_such_step")
    assert signature_mismatch("tasks.stage.stage(nothing)") is not None


def test_every_call_on_the_page_has_the_code_s_parameters():
    mismatches = [m for s in spans() if CALL.match(s) and (m := signature_mismatch(s))]
    assert not mismatches, "docs/architecture.md's signatures differ from the code:\n" + "\n".join(mismatches)


def test_every_dotted_name_on_the_page_exists():
    missing = []
    for s in spans():
        if is_code_name(s):
            try:
                resolve(s)
            except LookupError:
                missing.append(s)
    assert not missing, f"docs/architecture.md names what the code does not hold: {missing}"


def test_every_python_file_on_the_page_exists():
    files = [s for s in spans() if re.fullmatch(r"[\w/]+\.py", s)]
    assert files
    missing = [f for f in files if not any((ROOT / folder / f).is_file() for folder in PATH_FOLDERS)]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
