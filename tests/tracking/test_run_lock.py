"""One run per registered model at a time, whatever started it, and a lost lock stops its holder (issue 40
items 4 and 6). Real processes: a holder in its own process, `xbn register` beside it; a real PostgreSQL whose
backend holding the advisory lock is terminated, as a server restart or a failover ends it."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml
from infra.support import PG_HOST, PG_PORT, PG_USER, require_postgres

from xbn.cli import main
from xbn.tracking import Registry
from xbn.utils.integrity import verify_sidecar
from xbn.utils.locks import LockLost

from .helpers import run_pipeline, write_eval, write_model

PG = f"postgresql+psycopg2://{PG_USER}@{PG_HOST}:{PG_PORT}/postgres"

_HOLDER = """
import sys
from xbn.tracking.locks import run_lock
with run_lock(sys.argv[1], "xbn-embedder", "holder", 0, sys.argv[2] or None):
    print("held", flush=True)
    sys.stdin.readline()
"""


def _holder(uri: str, lock_uri: str | None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, uri, lock_uri or ""], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize("shared", [False, True], ids=["sqlite-file-lock", "postgresql-lock-uri"])
def test_a_second_run_on_the_same_model_refuses_to_start_and_says_why(params, tmp_path, capsys, shared):
    if shared:
        require_postgres()
        params.tracking.lock_uri = PG
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    write_model(params, 0)
    write_eval(params)
    holder = _holder(params.tracking.uri, params.tracking.lock_uri)
    try:
        assert main(["register", "--params", str(path), "-q"]) == 1
        err = capsys.readouterr().err
        assert "xbn register: another run on xbn-embedder is in progress" in err and "did not start" in err
        assert len(err.strip().splitlines()) == 1  # one line, no traceback
        assert Registry(params).by_alias("champion") is None  # nothing registered
    finally:
        holder.communicate("\n", timeout=30)
    assert main(["register", "--params", str(path), "-q"]) == 0  # free again


@pytest.fixture
def registry(params) -> Registry:
    """A registry with version 1 whose locks live on the real PostgreSQL (`tracking.lock_uri`), under a model name
    of its own: the database is shared with every test running beside this one, and the locks are named by model."""
    require_postgres()
    params.tracking.lock_uri = PG
    params.registry.model_name = f"xbn-embedder-{uuid.uuid4().hex[:8]}"
    run_pipeline(params, seed=0)
    return Registry(params)


def test_a_registry_lock_lost_with_its_connection_stops_the_holder_before_it_writes(registry):
    """Its connection ended, and another promotion took the lock meanwhile: the holder stops before it writes."""
    from xbn.utils.locks import advisory_lock

    with registry.lock() as held:
        registry.set_tags(1, {"note": "under the lock"})
        _terminate(held)
        with advisory_lock(PG, f"xbn-registry:{registry.name}", 0):  # another promotion, in between
            pass
        with pytest.raises(LockLost, match="another process held it meanwhile"):
            registry.set_tags(1, {"note": "unguarded"})
        with pytest.raises(LockLost):
            registry.set_alias("champion", 1)
    assert registry.get(1).tags["note"] == "under the lock"


def _terminate(held) -> None:
    """End the backend that holds `held`, as a PostgreSQL restart or a failover would."""
    with sa.create_engine(PG, isolation_level="AUTOCOMMIT").connect() as admin:
        backend = held._conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
        admin.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": backend})


def test_a_run_lock_lost_with_its_connection_is_taken_back_when_nobody_held_it_meanwhile(params, registry):
    """The run's lock dies with its connection; nobody took it: the next registry write takes it back (its
    epoch did not move) and goes on, and a second run still cannot start."""
    from xbn.tracking.locks import run_lock
    from xbn.utils.locks import LockTimeout, advisory_lock

    with run_lock(params.tracking.uri, registry.name, "first", 0, PG) as held:
        _terminate(held)
        registry.set_tags(1, {"note": "after the restart"})  # checks the run lock first: taken back
        assert held.regained == 1 and registry.get(1).tags["note"] == "after the restart"
        with pytest.raises(LockTimeout):  # another process's run still cannot start
            with advisory_lock(PG, f"xbn-run:{registry.name}", 0):
                pass


def test_a_run_lock_held_by_another_run_meanwhile_is_lost_for_good(params, registry):
    """The run's lock dies with its connection, and another run takes it and ends before the holder looks:
    the epoch moved, so the holder stops before it writes, although the lock is free again."""
    from xbn.tracking.locks import run_lock
    from xbn.utils.locks import advisory_lock

    with run_lock(params.tracking.uri, registry.name, "first", 0, PG) as held:
        _terminate(held)
        with advisory_lock(PG, f"xbn-run:{registry.name}", 0):  # another run, in between
            pass
        with pytest.raises(LockLost, match="another process held it meanwhile"):
            registry.set_tags(1, {"note": "unguarded"})
    assert "note" not in registry.get(1).tags


def test_a_run_whose_lock_another_run_held_meanwhile_overwrites_no_model_and_no_index(params, registry,
                                                                                         tmp_path):
    """Issue 54 items 8 and 9 (fencing): after a restart, another run took the lock and may be writing models/
    and the index folder; the first run, still training, stops at its next checkpoint or index write, before
    either becomes visible."""
    import numpy as np
    import pandas as pd

    from xbn.config import IndexConfig
    from xbn.serving.index import CatalogueIndex
    from xbn.tracking import file_digest
    from xbn.tracking.locks import run_lock
    from xbn.utils.locks import advisory_lock

    model = Path(params.train.checkpoint_dir) / "model.pt"
    before = file_digest(model)
    index = CatalogueIndex.build(np.eye(4, 8, dtype=np.float32), pd.DataFrame({"path": list("abcd")}),
                                 IndexConfig(), model_sha256=before)
    with run_lock(params.tracking.uri, registry.name, "first", 0, PG) as held:
        index.save(tmp_path / "served" / "index")  # the lock held: written
        _terminate(held)
        with advisory_lock(PG, f"xbn-run:{registry.name}", 0):  # another run, in between
            pass
        with pytest.raises(LockLost, match="another process held it meanwhile"):
            write_model(params, seed=7)
        with pytest.raises(LockLost):
            CatalogueIndex.build(np.eye(4, 8, dtype=np.float32)[::-1].copy(), pd.DataFrame({"path": list("wxyz")}),
                                 IndexConfig(), model_sha256=before).save(tmp_path / "served" / "index")
    assert file_digest(model) == before and verify_sidecar(model) == before  # the model and its sidecar intact
    assert sorted(CatalogueIndex.load(tmp_path / "served" / "index").ids["path"]) == list("abcd")
    assert [p.name for p in (tmp_path / "served").iterdir()] == ["index"]  # nothing half-written beside it


def test_a_tracking_server_without_a_shared_lock_is_refused_and_the_environment_names_the_lock(monkeypatch):
    """No machine-local stand-in for a server's missing lock (a host's rollback would not exclude a container's
    register); `$XBN_LOCK_URI` wins over `tracking.lock_uri`, as `$MLFLOW_TRACKING_URI` over `tracking.uri`."""
    from xbn.config import ConfigError
    from xbn.tracking.locks import LOCK_URI_ENV, registry_lock

    monkeypatch.delenv(LOCK_URI_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"^tracking\.lock_uri: the tracking server http://127\.0\.0\.1:1 offers no "
                                          r"lock.*set \$XBN_LOCK_URI \(or tracking\.lock_uri\)"):
        with registry_lock("http://127.0.0.1:1", "m", 0):
            pass
    require_postgres()
    monkeypatch.setenv(LOCK_URI_ENV, PG)
    unreachable = "postgresql+psycopg2://nobody@127.0.0.1:1/none"
    with registry_lock("http://127.0.0.1:1", f"m-{uuid.uuid4().hex[:8]}", 0, lock_uri=unreachable) as held:
        assert held is not None  # held in $XBN_LOCK_URI's PostgreSQL; the param's would not even connect
