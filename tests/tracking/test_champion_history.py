"""The champion's history is a log in the registry: rollbacks walk it back to the first champion whatever order
promotions took (concurrent ones included), a rollback with nothing to restore is one line and exit 1, `review`
shows the log, and the registry commands give up on a dead store within seconds (exit 4)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tests_support import free_port

from xbn.cli import main
from xbn.stages.register import promote, review, rollback
from xbn.tracking import Registry
from xbn.tracking.history import read_history
from xbn.utils.errors import EXIT_FAILURE, EXIT_SERVICE, RegistryError

from .helpers import run_pipeline


def _three_versions(params) -> None:
    """v1 champion (the gate's first model); v2 and v3 as good on val, so rejected: challengers only."""
    for seed in range(3):
        run_pipeline(params, seed=seed)
    assert Registry(params).by_alias("champion").version == 1


def _champion(params) -> int:
    return Registry(params).by_alias("champion").version


def _roll_back_until_refused(params, limit: int = 10) -> list[int]:
    """Roll back until there is nothing to roll back to; the champions restored, in order."""
    restored = []
    for _ in range(limit):
        try:
            restored.append(rollback(params, "walk back", user="ops")["champion_version"])
        except RegistryError as exc:
            assert str(exc).startswith("nothing to roll back to: v1 is the first champion"), exc
            return restored
    raise AssertionError(f"still rolling back after {limit} rollbacks (a cycle?): {restored}")


def test_rollbacks_walk_the_log_back_to_the_first_champion(params):
    _three_versions(params)
    # v2 <- v3 <- v2 again: with a per-version `previous_champion` pointer, v2 and v3 would point at each
    # other and rollback would alternate between them forever.
    for version, who in ((2, "alice"), (3, "bob"), (2, "alice")):
        promote(params, version, f"by hand: v{version}", user=who)
    assert _roll_back_until_refused(params) == [3, 2, 1]
    assert _champion(params) == 1

    log = read_history(Registry(params))
    assert [(e.seq, e.action, e.from_version, e.to_version, e.undoes) for e in log] == [
        (1, "gate", None, 1, None), (2, "promote", 1, 2, None), (3, "promote", 2, 3, None),
        (4, "promote", 3, 2, None), (5, "rollback", 2, 3, 4), (6, "rollback", 3, 2, 3),
        (7, "rollback", 2, 1, 2)]
    assert [e.by for e in log] == ["gate", "alice", "bob", "alice", "ops", "ops", "ops"]
    assert log[1].reason == "by hand: v2" and log[0].reason.startswith("first registered model")

    # A promotion after rollbacks continues the log: rolling it back restores v1, skipping what was undone.
    promote(params, 3, "again", user="carol")
    assert rollback(params, "no", user="ops")["champion_version"] == 1
    text = review(params)
    assert "champion history (newest first):" in text
    assert "#9 " in text and "rollback v3 -> v1 by ops (undoes #8): no" in text
    assert "#8 " in text and "promote v1 -> v3 by carol: again" in text


# Promotions in processes of their own, released together, each holding the registry lock in turn.
_PROMOTE = """
import sys, time
from pathlib import Path
from xbn.config import load_params
from xbn.stages.register import promote
params = load_params("params.yaml")
Path(f"ready-{sys.argv[2]}").touch()
while not Path(sys.argv[1]).exists():
    time.sleep(0.002)
promote(params, int(sys.argv[3]), "concurrent", user=f"p{sys.argv[2]}")
"""


def test_concurrent_promotions_leave_a_chain_that_rolls_back_to_v1(params, tmp_path):
    _three_versions(params)
    Path("params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    go = tmp_path / "go"
    targets = [2, 3, 2, 3]
    procs = [subprocess.Popen([sys.executable, "-c", _PROMOTE, str(go), str(i), str(v)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i, v in enumerate(targets)]
    deadline = time.monotonic() + 120
    while not all(Path(f"ready-{i}").exists() for i in range(len(targets))) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [p.communicate()[0][-3000:] for p in procs]
        time.sleep(0.01)
    go.touch()
    for proc in procs:
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, out[-3000:]

    log = read_history(Registry(params))
    # Serialised by the lock: each entry starts from the champion the previous one left, none is lost.
    assert [e.seq for e in log] == list(range(1, len(log) + 1))
    assert all(e.from_version == before.to_version for before, e in zip(log, log[1:])), log
    assert log[-1].to_version == _champion(params)
    moves = len(log) - 1  # a promotion of the version already champion changes nothing and logs nothing
    assert 2 <= moves <= len(targets)
    restored = _roll_back_until_refused(params)
    assert len(restored) == moves and restored[-1] == 1 and _champion(params) == 1


def test_rollback_with_nothing_to_roll_back_is_one_line_and_exit_1(params, capsys):
    Path("params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    def ours(err: str) -> list[str]:  # MLflow may log a line of its own ("Creating a new experiment")
        assert "Traceback" not in err
        return [line for line in err.splitlines() if line.startswith("xbn")]

    assert main(["registry", "rollback", "--reason", "oops"]) == EXIT_FAILURE  # no model registered at all
    assert ours(capsys.readouterr().err) == ["xbn registry: xbn-embedder has no champion to roll back"]
    run_pipeline(params, seed=0)
    capsys.readouterr()
    assert main(["registry", "rollback", "--reason", "oops"]) == EXIT_FAILURE
    [line] = ours(capsys.readouterr().err)
    assert line.startswith("xbn registry: nothing to roll back to: v1 is the first champion of xbn-embedder")
    assert _champion(params) == 1


@pytest.mark.parametrize("action", [["review"], ["rollback", "--reason", "x"], ["promote", "--model-version", "1",
                                                                          "--reason", "x"]])
def test_registry_commands_give_up_on_a_dead_store_within_seconds(params, action, capsys):
    uri = f"http://127.0.0.1:{free_port()}"
    Path("params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    start = time.monotonic()  # in this process: the time is the command's, not Python's and MLflow's imports
    assert main(["registry", "--set", f"tracking.uri={uri}", *action]) == EXIT_SERVICE
    took = time.monotonic() - start
    assert took < 10, took  # the MLflow client alone would retry for minutes
    err = capsys.readouterr().err
    assert f"xbn registry: the MLflow tracking store {uri} is not reachable" in err and "Traceback" not in err


_APPEND = """
import sys
from xbn.config import load_params
from xbn.tracking import Registry
from xbn.tracking.history import append_history
append_history(Registry(load_params(sys.argv[1])), by="a", action="promote", from_version=1, to_version=1,
               reason="the writer that read first")
"""


def test_two_writers_that_read_the_same_last_entry_both_keep_theirs(params, tmp_path):
    """Two writers meet (one lost its lock with its connection): A reads #1 and is held before it writes (a fault
    point); B reads #1 and writes #2; A then writes #2 too, reads it back, finds B's, withdraws and appends #3.
    With one tag per seq, A's write replaced B's entry: a move of the champion gone from its history."""
    from xbn.tracking.history import append_history
    from xbn.utils.faults import FAULT_DIR_ENV, FAULT_ENV

    run_pipeline(params, seed=0)  # v1, the champion: entry #1
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    env = {**__import__("os").environ, FAULT_ENV: "history.before_write:wait", FAULT_DIR_ENV: str(tmp_path)}
    writer = subprocess.Popen([sys.executable, "-c", _APPEND, str(path)], env=env, stderr=subprocess.PIPE, text=True)
    reached, deadline = tmp_path / "history.before_write.reached", time.monotonic() + 120
    while not reached.exists():
        assert writer.poll() is None and time.monotonic() < deadline, writer.stderr and writer.stderr.read()
        time.sleep(0.1)
    append_history(Registry(params), by="b", action="promote", from_version=1, to_version=1, reason="second")
    (tmp_path / "history.before_write.release").touch()
    assert writer.wait(timeout=120) == 0, writer.stderr.read()
    log = read_history(Registry(params))
    assert [(e.seq, e.by) for e in log] == [(1, log[0].by), (2, "b"), (3, "a")]
    assert "another writer took #2" in writer.stderr.read()


def _killed_rollback(params, tmp_path) -> None:
    """v1 champion, v2 promoted by hand; then `xbn registry rollback` SIGKILLed between its history entry and
    its alias move (fault point rollback.after_history)."""
    from xbn.utils.faults import FAULT_ENV

    _three_versions(params)
    promote(params, 2, "by hand", user="alice")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    done = subprocess.run([sys.executable, "-m", "xbn.cli", "registry", "--params", str(path), "rollback",
                           "--reason", "regression", "--user", "bob"], cwd=tmp_path, capture_output=True, text=True,
                          env={**__import__("os").environ, FAULT_ENV: "rollback.after_history:kill"}, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    log = read_history(Registry(params))
    assert log[-1].action == "rollback" and _champion(params) == 2  # logged, alias not moved


def test_a_rollback_killed_before_its_alias_moved_is_finished_by_its_retry(params, tmp_path):
    _killed_rollback(params, tmp_path)
    report = rollback(params, "regression, again", user="bob")  # refused before: 'moved outside xbn'
    assert report["champion_version"] == 1 and _champion(params) == 1
    log = read_history(Registry(params))
    assert [(e.action, e.from_version, e.to_version, e.by) for e in log[-2:]] == [
        ("promote", 1, 2, "alice"), ("rollback", 2, 1, "bob")]  # the one rollback, not a second


def test_the_next_runs_repair_finishes_a_logged_move_whose_alias_never_moved(params, tmp_path):
    from xbn.stages.loop import repair

    _killed_rollback(params, tmp_path)
    repaired = repair(params)  # (then it indexes the champion: these tests' registry has no index attached)
    assert repaired[0].title == "xbn: champion v1 restored from its history"
    assert _champion(params) == 1 and "restored" not in str([r.title for r in repair(params)])
