"""A write that dies half-way leaves the previous file as it was and no temp file: a later stage never reads a
truncated artifact."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest
import torch

from xbn.utils.io import save_torch, write_json


class Unserializable:
    pass


def test_a_failed_json_write_keeps_the_previous_file_whole(tmp_path):
    path = tmp_path / "metrics" / "eval.json"
    write_json(path, {"recall@1": 0.5})
    # json.dumps fails on the last key, after the others were rendered: nothing reaches the target.
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json(path, {"a": 1, "b": list(range(10_000)), "z": Unserializable()})
    assert json.loads(path.read_text()) == {"recall@1": 0.5}
    assert sorted(p.name for p in path.parent.iterdir()) == ["eval.json"]


def test_a_checkpoint_write_killed_half_way_keeps_the_last_good_one(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_torch(path, {"epoch": 1, "w": torch.ones(1000)})
    real_save = torch.save

    def dies_half_way(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        with open(f, "r+b") as fh:  # a partial file on disk, then the process "dies"
            fh.truncate(100)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_torch(path, {"epoch": 2, "w": torch.zeros(1000)})
    state = torch.load(path, weights_only=True)
    assert state["epoch"] == 1 and torch.equal(state["w"], torch.ones(1000))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_a_written_file_gets_the_mode_the_umask_gives(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        save_torch(tmp_path / "a.pt", {"x": torch.ones(1)})
        os.umask(0o077)
        write_json(tmp_path / "private.json", {"x": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "a.pt").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private.json").stat().st_mode) == 0o600


# A real process killed with SIGKILL while it writes (as a lost machine or an OOM kill would): nothing of the
# writer's `finally` runs, so its temp file stays behind.
_KILLED_WRITER = """
import os, signal, sys
from xbn.utils.io import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    print(tmp.name, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_temp_file_left_by_a_killed_first_save_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "models" / "last.pt"
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(target)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL
    left = proc.stdout.strip()
    assert [p.name for p in target.parent.iterdir()] == [left]  # the kill leaves the temp file, named
    assert left.startswith(".last.pt.") and left.endswith(".tmp")
    save_torch(target, {"epoch": 1})
    assert [p.name for p in target.parent.iterdir()] == ["last.pt"]
    assert torch.load(target, weights_only=True) == {"epoch": 1}


def test_the_next_write_leaves_a_live_writers_temp_file_alone(tmp_path):
    # Another process that is still writing the same file keeps its temp file (it renames it when done).
    target = tmp_path / "eval.json"
    writer = subprocess.Popen([sys.executable, "-c", _LIVE_WRITER, str(target)], stdout=subprocess.PIPE,
                              stdin=subprocess.PIPE, text=True)
    try:
        live = writer.stdout.readline().strip()
        write_json(target, {"mine": 1})
        assert (tmp_path / live).exists()
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.wait(timeout=60) == 0
    finally:
        writer.kill()
    assert json.loads(target.read_text()) == {"theirs": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]


_LIVE_WRITER = """
import sys
from xbn.utils.io import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    print(tmp.name, flush=True)
    sys.stdin.readline()
    tmp.write_text('{"theirs": 1}')
"""


def test_a_temp_file_of_the_older_naming_is_removed_only_once_it_is_an_hour_old(tmp_path):
    # Writers before the host.pid naming left `.<name>.XXXXXXXX.tmp`: no pid to ask, so age decides.
    target = tmp_path / "metrics.json"
    old, fresh = tmp_path / ".metrics.json.ab12cd34.tmp", tmp_path / ".metrics.json.zz98yy76.tmp"
    old.write_bytes(b""), fresh.write_bytes(b"")
    two_hours_ago = os.path.getmtime(old) - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    write_json(target, {"ok": 1})
    assert json.loads(target.read_text()) == {"ok": 1}
    assert not old.exists() and fresh.exists()
