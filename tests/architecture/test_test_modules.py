"""Test modules share helpers through support modules (tests_support, a folder's helpers or support module),
never by importing another test module: an import of a test module collects its tests twice under another
name, and a helper's users are invisible to whoever edits that test. One port finder, not one per folder."""

from __future__ import annotations

import ast
import re

from tests_support import ROOT

TESTS = ROOT / "tests"


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_no_test_module_imports_another():
    found = [f"{path.relative_to(TESTS)}: {module}" for path in TESTS.rglob("test_*.py")
             for module in _imports(path) if module.rsplit(".", 1)[-1].startswith("test_")]
    assert found == []


def test_one_free_port_helper():
    defined = [str(path.relative_to(TESTS)) for path in TESTS.rglob("*.py")
               if re.search(r"^def _?(free|closed)_port\(", path.read_text(), re.M)]
    assert defined == ["tests_support.py"]
