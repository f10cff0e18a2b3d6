"""The kernel tests on CPU tensors run in a pytest of their own under TRITON_INTERPRET=1 (tests/conftest.py):
that pytest runs only them, and any other pytest skips them, saying what they need."""

from __future__ import annotations

import pytest
from conftest import split_interpreter_tests

SOURCE = """
import pytest

@pytest.mark.interpreter
def test_kernel():
    pass

def test_plain():
    pass
"""


def collected(pytester: pytest.Pytester) -> list[pytest.Item]:
    pytester.makepyfile(test_kernels=SOURCE)
    items, _ = pytester.inline_genitems()
    return items


def test_under_the_interpreter_only_the_kernel_tests_are_kept(pytester):
    items = collected(pytester)
    split_interpreter_tests(items[0].config, items, in_interpreter=True)
    assert [item.name for item in items] == ["test_kernel"]


def test_elsewhere_the_kernel_tests_skip_naming_what_they_need(pytester):
    items = collected(pytester)
    split_interpreter_tests(items[0].config, items, in_interpreter=False)
    kernel, plain = items
    skip = kernel.get_closest_marker("skip")
    assert skip is not None and ("TRITON_INTERPRET=1" in skip.kwargs["reason"] or "triton package" in skip.kwargs["reason"])
    assert plain.get_closest_marker("skip") is None
