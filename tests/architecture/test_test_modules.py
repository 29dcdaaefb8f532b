"""Test modules share helpers through support modules (tests_support, a folder's helpers or support module),
never by importing another test module: an import of a test module collects its tests twice under another
name, and a helper's users are invisible to whoever edits that test. One copy of each shared helper: one port
finder, one notification receiver, one Prefect harness, one migrated MLflow store."""

from __future__ import annotations

import ast
import re

import pytest

from tests_support import ROOT

TESTS = ROOT / "tests"


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_nothing_imports_a_test_module():
    """Test modules, conftests and support modules alike."""
    found = [f"{path.relative_to(TESTS)}: {module}" for path in TESTS.rglob("*.py")
             for module in _imports(path) if module.rsplit(".", 1)[-1].startswith("test_")]
    assert found == []


@pytest.mark.parametrize(("helper", "home"), [
    (r"^def _?(free|closed)_port\(", "tests_support.py"),
    (r"^class \w*Receiver\b", "tests_support.py"),  # the notifications' HTTP receiver
    (r"prefect_test_harness\(", "conftest.py"),
    (r"^def \w*(store|mlflow)_template\(", "conftest.py"),  # the migrated MLflow store each test copies
])
def test_one_copy_of_each_shared_helper(helper, home):
    defined = sorted(str(path.relative_to(TESTS)) for path in TESTS.rglob("*.py")
                     if path.name != "test_test_modules.py" and re.search(helper, path.read_text(), re.M))
    assert defined == [home]
