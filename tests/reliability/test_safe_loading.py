"""Every torch.load in the code reads weights only (no pickled code runs from an untrusted file)."""

from __future__ import annotations

import ast

from tests_support import ROOT


def _torch_loads(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
            yield node


def test_every_torch_load_passes_weights_only_true():
    files = [path for folder in ("src", "pipelines", "benchmarks") for path in (ROOT / folder).rglob("*.py")]
    calls, unsafe = 0, []
    for path in files:
        for call in _torch_loads(ast.parse(path.read_text(), str(path))):
            calls += 1
            flag = next((k.value for k in call.keywords if k.arg == "weights_only"), None)
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                unsafe.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert calls >= 4, "found no torch.load at all: the scan is broken"
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"
