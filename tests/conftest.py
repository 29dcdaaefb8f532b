"""Shared fixtures: a tiny generated glyph set and params for a tiny model, so end-to-end tests stay fast."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # its thread races client requests (see Makefile)
# An `mlflow server` starts a job runner (about 7 huey consumers) by default, each with its own pool of connections
# to the backend store; xbn runs no MLflow jobs. Beside the other PostgreSQL users of a run (the tuning workers,
# a Prefect server) they took the shared server past its 100 connections ("sorry, too many clients already").
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
# Every `dvc` command otherwise forks an analytics daemon (a Python process that imports DVC: 0.5 s of CPU each,
# about 60 of them in a run of the suite).
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
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
# make test's xdist workers share the cores (three on two): one OpenMP thread each, and in every process they
# start. Threads that outnumber the cores spin-wait on each other (measured: a bf16 test 4 s alone, 76 s beside
# the other worker).
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


@pytest.fixture(autouse=True)
def mlflow_account_put_back():
    """xbn moves a tracking URI's embedded account into MLFLOW_TRACKING_USERNAME/PASSWORD for the process
    (`account_to_environment`): each test leaves the next one the account it found."""
    names = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def prefect_harness(tmp_path_factory):
    """Flows run for real against Prefect's test harness (a temporary database and API server), one per module:
    its own PREFECT_HOME, put back afterwards so that later modules' subprocesses do not inherit it."""
    from prefect.testing.utilities import prefect_test_harness

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect_home")))
        with prefect_test_harness(server_startup_timeout=120):
            yield


@pytest.fixture(scope="session")
def mlflow_store_template(tmp_path_factory) -> Path:
    """An SQLite MLflow store with its schema migrated (alembic takes seconds on a fresh store): made once per
    session, copied by each test that needs a store of its own."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def tiny_params(tmp_path, glyph_root, monkeypatch):
    """Params for a tiny run in tmp_path (the working directory) on the shared tiny glyph set."""
    from xbn.config import load_params

    monkeypatch.chdir(tmp_path)

    def make(*overrides: str):
        return load_params(ROOT / "params.yaml", [*TINY, f"data.root={glyph_root}", *overrides])

    return make


# The suite's tiers, from one table: the first entry whose path prefix (under tests/) matches a module gives its
# tier; everything else is `unit` (no subprocess, no server, no training beyond a few steps). `make test-fast`
# runs the unit tier alone, with every unit test held to UNIT_LIMIT_S; `make test` runs all four.
# - integration: subprocesses, tiny trainings, DVC, an SQLite MLflow store, uvicorn in a thread;
# - services: PostgreSQL, the MLflow and Prefect servers;
# - faults: the weekly loop's fault suite (every service, killed and cut).
TIERS = [
    ("faults/", "faults"),
    ("infra/", "services"), ("tuning/test_workers.py", "services"), ("tuning/test_storage.py", "services"),
    ("tracking/test_concurrent_promotion.py", "services"), ("tracking/test_run_lock.py", "services"),
    ("architecture/test_suite_grouping.py", "integration"), ("architecture/test_light_imports.py", "integration"),
    ("console/", "integration"),
    ("data/test_snapshot.py", "integration"), ("data/test_dvc_live_lock.py", "integration"),
    ("data/test_cache.py", "integration"), ("data/test_loading.py", "integration"),
    ("distributed/", "integration"), ("pipeline/", "integration"), ("reliability/", "integration"),
    ("refine/", "integration"), ("serving/", "integration"), ("tracking/", "integration"),
    ("training/", "integration"), ("tuning/", "integration"), ("validation/", "integration"),
    ("models/test_mpn.py", "integration"), ("models/test_backbone.py", "integration"),
    ("evaluation/test_inference.py", "integration"), ("evaluation/test_embedding_space.py", "integration"),
    # over 5 s on the 2-core EPYC (make test-fast): 12 s, 12 s, a subprocess, 200 memory steps in 6 s
    ("evaluation/test_knn_search.py", "integration"), ("evaluation/test_retrieval_metrics.py", "integration"),
    ("config/test_checked_up_front.py", "integration"), ("memory/test_equivalence.py", "integration"),
]
TIER_NAMES = ("unit", "integration", "services", "faults")
UNIT_LIMIT_S = 5.0


def tier_of(relative: str) -> str:
    return next((tier for prefix, tier in TIERS if relative.startswith(prefix)), "unit")


def pytest_collection_modifyitems(config, items):
    """Each test gets its tier's marker (`TIERS`). The `slow` tests go first in the collection, but xdist's
    loadfile hands modules out by their number of tests (most first), so this decides only among modules of equal
    count. Handing them out heaviest tier first (`--no-loadscope-reorder`) was measured and did not pay: it removed
    the 90 s where one worker idles at the end, but running the server-heavy modules side by side cost as much
    CPU (make test 15 min 38 s against 15 min 43 s, user CPU 24.2 min against 22.6)."""
    tests = Path(__file__).parent
    for item in items:
        tier = tier_of(Path(str(item.path)).relative_to(tests).as_posix())
        item.add_marker(getattr(pytest.mark, "integration" if tier == "unit" and item.get_closest_marker("slow")
                                else tier))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With $XBN_UNIT_LIMIT_S set (make test-fast), a unit test that runs longer fails, naming itself: it belongs
    in another tier, or should be made fast."""
    outcome = yield
    report = outcome.get_result()
    limit = os.environ.get("XBN_UNIT_LIMIT_S")
    if limit and call.when == "call" and report.passed and item.get_closest_marker("unit") \
            and call.duration > float(limit):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} is a unit test but took {call.duration:.1f} s (> {limit} s): make it "
                           f"faster, or give its module another tier in tests/conftest.py's TIERS")
