"""The package's layers, and dvc.yaml's deps, checked against the imports the code actually makes (every
`import` statement, those inside functions included): a module never imports from a higher layer, and a DVC
stage lists every source file its command can run, so a change anywhere in it re-runs the stage."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
# Lower numbers are lower floors; a module may import its own floor and those below.
LAYERS = {
    "utils": 0,
    "config": 1,
    "data": 2, "models": 2, "losses": 2, "memory": 2, "evaluation": 2, "validation": 2,
    "training": 3, "tracking": 3, "tuning": 3,
    "serving": 4,
    "stages": 5,
    "cli": 6, "__main__": 6, "flows": 6,  # the Prefect flows: over the stages, called by the CLI
}


def module_file(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def imports_of(path: Path, typing_only: bool = True) -> frozenset[str]:
    """The xbn modules `path` imports (a `from xbn.x import name` counts `xbn.x.name` when that is a module);
    `typing_only=False` leaves out those under `if TYPE_CHECKING:`, which never run."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skipped = set() if typing_only else {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                                         and "TYPE_CHECKING" in ast.unparse(block.test)
                                         for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "xbn")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "xbn":
                continue
            submodules = {f"{base}.{a.name}" for a in node.names if module_file(f"{base}.{a.name}")}
            found.update(submodules)
            if len(submodules) < len(node.names):  # a name defined by `base` itself, not only its submodules
                found.add(base)
    return frozenset(m for m in found if module_file(m))


def closure(start: str) -> set[Path]:
    """Every file that importing `start` can execute: its imports, recursively, and their packages' inits."""
    seen: set[Path] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            path = module_file(".".join(parts[:i]))
            if path is not None and path not in seen:
                seen.add(path)
                todo.extend(imports_of(path))
    return seen


def layer(name: str) -> int:
    return LAYERS[name.split(".")[1]] if "." in name else LAYERS["cli"]


SOURCES = sorted((SRC / "xbn").rglob("*.py"))


def test_every_floor_is_named():
    assert {p.relative_to(SRC / "xbn").parts[0].removesuffix(".py") for p in SOURCES} - {"__init__"} <= \
        LAYERS.keys()


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_imports_from_a_higher_layer(path):
    me = module_name(path)
    if me == "xbn":
        return
    upward = sorted(m for m in imports_of(path) if m != "xbn" and layer(m) > layer(me))
    assert not upward, f"{me} (layer {layer(me)}) imports from higher layers: {upward}"


# What `pip install xbn` (no extras) installs, and the standard library: all that xbn.memory may import.
LIBRARY_PACKAGES = {"torch", "pytorch_metric_learning", "numpy", "__future__"}


def third_party_imports(path: Path, tree: ast.AST | None = None) -> set[str]:
    import sys

    tree = tree if tree is not None else ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level and n.module}
    return {name.split(".")[0] for name in names} - set(sys.stdlib_module_names) - {"xbn"}


def test_the_memory_library_imports_nothing_of_the_pipeline():
    """`import xbn.memory` runs only the memory's own modules and the error types, and those import only the
    packages of a no-extras install (tests/console/test_installed.py installs one and trains with it)."""
    files = {str(p.relative_to(SRC)) for p in closure("xbn.memory")}
    assert "xbn/memory/methods.py" in files
    assert files <= {"xbn/__init__.py", "xbn/utils/__init__.py", "xbn/utils/errors.py"} | {
        str(p.relative_to(SRC)) for p in (SRC / "xbn" / "memory").glob("*.py")}, files
    packages = set().union(*(third_party_imports(SRC / f) for f in files))
    assert packages <= LIBRARY_PACKAGES, packages - LIBRARY_PACKAGES


@cache
def _runs_at_import(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """The xbn modules and the third-party packages `path` imports when it is imported (not inside functions,
    not under TYPE_CHECKING)."""
    def at_import(node: ast.AST):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or (
                    isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)):
                continue
            yield child
            yield from at_import(child)

    module = ast.Module(body=[n for n in at_import(ast.parse(path.read_text()))
                              if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[])
    own = frozenset(m for m in imports_of(path, typing_only=False) if _imported_at_top(module, m))
    return own, frozenset(third_party_imports(path, module))


@cache
def top_level_closure(start: str) -> frozenset[str]:
    """The third-party packages that importing `start` loads at once, through every xbn module it runs."""
    seen: set[Path] = set()
    packages: set[str] = set()
    todo = [start]
    while todo:
        parts = todo.pop().split(".")
        for i in range(1, len(parts) + 1):
            path = module_file(".".join(parts[:i]))
            if path is None or path in seen:
                continue
            seen.add(path)
            own, third = _runs_at_import(path)
            packages |= third
            todo.extend(own)
    return frozenset(packages)


def _imported(node: ast.ImportFrom) -> set[str]:
    """The modules `from X import a, b` runs: X, and X.a where that is a module of its own."""
    return {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names if module_file(f"{node.module}.{a.name}")}


def _imported_at_top(module: ast.Module, name: str) -> bool:
    return any(any(a.name == name for a in n.names) if isinstance(n, ast.Import) else
               (n.module == name or any(f"{n.module}.{a.name}" == name for a in n.names)) for n in module.body)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_xbn_modules_are_imported_at_the_top_unless_they_bring_a_package(path):
    """An xbn module imported inside a function must bring a package that this module does not load already
    (torch, MLflow, Prefect, faiss, onnx...: heavy, or an extra's): the one reason to defer it. Anything else
    goes to the top of the file, where a reader sees what the module depends on."""
    me = module_name(path)
    mine = top_level_closure(me)
    tree = ast.parse(path.read_text())
    deferred = {n for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                for n in ast.walk(f) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("xbn")}
    needless = sorted((n.lineno, n.module) for n in deferred
                      if not set().union(*(top_level_closure(m) for m in _imported(n))) - mine)
    assert not needless, f"{me}: these bring no package it lacks, so belong at the top: {needless}"


def stage_entries() -> dict[str, set[str]]:
    """Each `xbn <command>` of dvc.yaml: the xbn modules its CLI handler imports."""
    tree = ast.parse((SRC / "xbn" / "cli.py").read_text())
    handlers = {node.name.removeprefix("_stage_"): node for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name.startswith("_stage_")}
    module_of = {alias.asname or alias.name: (f"{node.module}.{alias.name}" if module_file(f"{node.module}.{alias.name}")
                                              else node.module)
                 for node in tree.body if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xbn")
                 for alias in node.names}
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    entries = {}
    for stage, spec in stages.items():
        command = spec["cmd"].split()[1]
        imported = {n.module for n in ast.walk(handlers[command]) if isinstance(n, ast.ImportFrom)}
        used = {n.id for statement in handlers[command].body for n in ast.walk(statement)  # names from cli's top
                if isinstance(n, ast.Name)}
        imported |= {module_of[name] for name in used if name in module_of}
        entries[stage] = {m for m in imported if m and m.startswith("xbn")}
    return entries


@pytest.mark.parametrize("stage", sorted(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]))
def test_dvc_stage_deps_cover_every_module_the_stage_runs(stage):
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]
    deps = [ROOT / d for d in spec["deps"] if "${" not in d]
    files: set[Path] = set()
    for entry in stage_entries()[stage]:
        files |= closure(entry)
    missing = sorted(str(f.relative_to(ROOT)) for f in files
                     if not any(f == d or d in f.parents for d in deps))
    assert files and not missing, f"dvc.yaml stage '{stage}' does not list these files it runs: {missing}"


def test_the_checks_see_a_missing_dep(tmp_path):
    # The closure is not vacuous: the train stage runs the criterion and the memory's moment estimators.
    files = {str(p.relative_to(SRC)) for p in closure("xbn.stages.train")}
    assert {"xbn/training/criterion.py", "xbn/memory/moments.py", "xbn/config/schema.py",
            "xbn/utils/distributed.py"} <= files


def test_no_import_circles():
    """No module can reach itself through the imports it runs (those inside functions included): a circle is held
    open only by the order things happen to be imported in. Tarjan's strongly connected components."""
    graph = {module_name(p): imports_of(p, typing_only=False) for p in SOURCES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"
