"""Concurrent promotion against one real store: two `register` processes racing leave one champion, a
decision on both versions, and a gate that compared the second with the first; promotion is idempotent and
rollback restores the previous champion. The lock itself is checked with real processes and SIGKILL."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from xbn.stages.register import promote, rollback
from xbn.tracking import log_model, pipeline_run
from xbn.tracking.locks import RegistryLockTimeout, lock_key, registry_lock

from .helpers import write_eval, write_model

LOCKS = Path(__file__).resolve().parents[2] / "src/xbn/tracking/locks.py"


def _workdir(params, root: Path, seed: int, recall: float, blind: bool = False) -> Path:
    """A project directory of its own (model, eval results, the same manifest and images) sharing the test's
    store, with its model already logged to its run (as `xbn train` leaves it), so `register` goes straight to
    deciding."""
    cwd = Path.cwd()
    root.mkdir()
    shutil.copytree(cwd / "data", root / "data")
    os.chdir(root)
    try:
        write_model(params, seed, blind)
        write_eval(params, **{"recall@1": recall})
        with pipeline_run(params, "train", new=True) as run:
            log_model(params, run)
    finally:
        os.chdir(cwd)
    (root / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    return root


# `register` in a process of its own, released by the test together with its rival, so that both read the
# registry at the same moment (without the lock both would see no champion and both would win).
_REGISTER = """
import sys, time
from pathlib import Path
from xbn.config import load_params
from xbn.stages.register import register
params = load_params("params.yaml")
Path("ready").touch()
while not Path(sys.argv[1]).exists():
    time.sleep(0.002)
register(params)
"""


def test_two_racing_registers_leave_one_champion_and_a_decision_on_both(params, tmp_path):
    # a is blind on val, b sees: b second beats a, a second loses to b.
    dirs = [_workdir(params, tmp_path / "a", seed=1, recall=0.5, blind=True),
            _workdir(params, tmp_path / "b", seed=2, recall=0.6)]
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _REGISTER, str(go)], cwd=d, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for d in dirs]
    deadline = time.monotonic() + 120
    while not all((d / "ready").exists() for d in dirs) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [p.communicate()[0][-3000:] for p in procs]
        time.sleep(0.01)
    go.touch()
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]

    client = MlflowClient(params.tracking.uri)
    name = params.registry.model_name
    found = {int(v.version): client.get_model_version(name, v.version)
             for v in client.search_model_versions(f"name = '{name}'")}
    assert sorted(found) == [1, 2]
    champions = [v for v, mv in found.items() if "champion" in mv.aliases]
    assert len(champions) == 1
    assert all(mv.tags.get("decision") in ("promoted", "rejected") for mv in found.values())
    # Serialised: exactly one saw an empty registry; the other was gated against it.
    first = [v for v, mv in found.items() if "first registered model" in mv.tags["reason"]]
    assert first == [1], {v: mv.tags["reason"] for v, mv in found.items()}
    second = found[2]
    assert "champion v1" in second.tags["reason"] and second.tags["gate_interval"].endswith("vs v1")
    if second.tags["decision"] == "promoted":  # b (better) came second
        assert champions == [2] and second.tags["previous_champion"] == "1"
    else:  # a (worse) came second
        assert champions == [1] and second.tags["decision"] == "rejected"

    # Promoting the champion again changes nothing.
    champion = champions[0]
    before = client.get_model_version(name, str(champion))
    again = promote(params, champion, "re-run of the same promotion", user="ops")
    assert again["decision"] == "unchanged"
    after = client.get_model_version(name, str(champion))
    assert after.tags == before.tags and after.aliases == before.aliases

    # Promote the other by hand, then roll back: the previous champion returns.
    other = 3 - champion
    assert promote(params, other, "manual", user="ops")["champion_version"] == other
    restored = rollback(params, "regression seen in production", user="ops")
    assert restored["version"] == champion and restored["champion_version"] == champion
    assert client.get_model_version(name, str(other)).tags["decision"] == "rolled_back"


_HOLDER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("locks", sys.argv[1])
locks = importlib.util.module_from_spec(spec); spec.loader.exec_module(locks)
with locks.registry_lock(sys.argv[2], "m"):
    print("held", flush=True)
    sys.stdin.read()  # hold until killed
"""


def _hold(uri: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(LOCKS), uri], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _check_lock_excludes_and_dies_with_its_holder(uri: str) -> None:
    holder = _hold(uri)
    try:
        with pytest.raises(RegistryLockTimeout):
            with registry_lock(uri, "m", timeout=0.5):
                pass
        if uri.startswith("postgresql"):  # advisory locks are per model (a file lock is per store)
            with registry_lock(uri, "other-model", timeout=5):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with registry_lock(uri, "m", timeout=10):  # a killed holder leaves no stale lock behind
        pass


def test_sqlite_lock_is_a_file_next_to_the_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'store/mlflow.db'}"
    with registry_lock(uri, "m", timeout=1):
        assert (tmp_path / "store/mlflow.db.registry.lock").exists()
    _check_lock_excludes_and_dies_with_its_holder(uri)


def test_postgres_store_uses_an_advisory_lock():
    from infra.support import PG_HOST, PG_PORT, PG_USER, admin_execute, require_postgres

    require_postgres()
    uri = f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/postgres"
    holder = _hold(uri)
    try:
        rows = admin_execute("SELECT objid::bigint, classid::bigint FROM pg_locks "
                             "WHERE locktype = 'advisory'")
        key = lock_key("m")
        # pg_locks splits the 64-bit key into classid (high) and objid (low) 32-bit halves.
        assert any(((c << 32) | o) == key % (1 << 64) for o, c in rows), rows
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    _check_lock_excludes_and_dies_with_its_holder(uri)
