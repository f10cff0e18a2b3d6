"""A package's names imported when first used (PEP 562), so that importing one light module of the package
does not import the heavy ones beside it (torch, the Triton client) for names it never touches.

Imports: stdlib only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, namespace: dict[str, Any],
                 exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose `exports` map each name to the submodule defining it;
    a name once imported is kept in the package's `namespace` (its globals)."""

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *exports})

    return getattr_, dir_
