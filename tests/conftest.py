"""Shared fixtures: a tiny generated glyph set and params for a tiny model, so end-to-end tests stay fast."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # its thread races client requests (see Makefile)
# The bf16 fast paths (xbn.utils.cpu) are off unless a test turns them on: runs that tests compare across
# processes must not differ by a probe. tests/evaluation/test_inference.py and the kNN tests pin both branches.
os.environ.setdefault("XBN_CPU_BF16", "0")
# Likewise `inference.engine: auto` keeps torch (no ONNX export, no race) unless a test turns ONNX Runtime on
# (tests/serving/test_engine.py); graphs a test exports are cached under a temporary folder, not ~/.cache.
os.environ.setdefault("XBN_ONNXRUNTIME", "0")
if "XBN_CACHE_DIR" not in os.environ:  # before xdist starts its workers: they share it; its maker removes it
    import atexit
    import shutil
    import tempfile

    os.environ["XBN_CACHE_DIR"] = tempfile.mkdtemp(prefix="xbn-test-cache-")
    atexit.register(shutil.rmtree, os.environ["XBN_CACHE_DIR"], True)
# make test's two xdist workers share 2 cores: one OpenMP thread each, and in every process they start. Threads
# that outnumber the cores spin-wait on each other (measured: a bf16 test 4 s alone, 76 s beside the other worker).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

# `import dvc` binds DVC's log handlers to the sys.stdout of that moment (dvc/__init__.py calls logger.setup()).
# Imported first inside a test that uses capsys, they would hold that test's capture, closed when it ends, and
# the next in-process DVC call that logs (repo.add's "git add" hint) would raise. Import it while the
# session-wide stream is in place.
import dvc  # noqa: E402, F401

from tests_support import ROOT, TINY  # noqa: E402


@pytest.fixture(scope="session")
def glyph_root(tmp_path_factory) -> Path:
    from xbn.data.glyphs import generate_glyphs

    root = tmp_path_factory.mktemp("glyphs") / "glyphs"
    generate_glyphs(root, classes=24, images_per_class=4, image_size=32, seed=0)
    return root


@pytest.fixture
def tiny_params(tmp_path, glyph_root, monkeypatch):
    """Params for a tiny run in tmp_path (the working directory) on the shared tiny glyph set."""
    from xbn.config import load_params

    monkeypatch.chdir(tmp_path)

    def make(*overrides: str):
        return load_params(ROOT / "params.yaml", [*TINY, f"data.root={glyph_root}", *overrides])

    return make


def pytest_collection_modifyitems(config, items):
    """The `slow` tests first: xdist hands tests out in collection order, so a 3-minute end-to-end test that
    starts last leaves the other worker idle at the end (make test's wall time is the busier worker's)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order
