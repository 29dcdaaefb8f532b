"""Issue 54 item 3: the repair of DVC's rwlock drops an entry only when its PID provably runs another program.
DVC records `" ".join(sys.argv)`, which for a Python program leaves out the interpreter (psutil's cmdline has
it), so comparing the two verbatim took every live `dvc` for a reused PID and deleted the running flow's locks.
Here a real `dvc repro` holds the lock while the repair runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from xbn.data.dvc_files import _may_have_recorded, repair_dvc_files

DVC = str(Path(sys.executable).with_name("dvc"))


def test_a_live_dvc_holding_its_lock_keeps_it(tmp_path):
    subprocess.run([DVC, "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text("stages:\n  slow:\n    cmd: sleep 30 && echo done > out.txt\n"
                                       "    outs: [out.txt]\n")
    holder = subprocess.Popen([DVC, "repro", "-q"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    rwlock = tmp_path / ".dvc" / "tmp" / "rwlock"
    try:
        deadline = time.monotonic() + 60
        while not (rwlock.is_file() and str(holder.pid) in rwlock.read_text()):
            assert holder.poll() is None and time.monotonic() < deadline, "dvc repro never took its lock"
            time.sleep(0.1)
        before = json.loads(rwlock.read_text())
        assert repair_dvc_files(tmp_path) == []
        assert json.loads(rwlock.read_text()) == before  # the live holder's entry is still there
    finally:
        holder.kill()
        holder.wait()


def test_another_program_on_the_pid_is_told_apart_from_the_recorder():
    venv_dvc = "/venv/bin/dvc"
    assert _may_have_recorded(["/venv/bin/python3.11", venv_dvc, "repro", "-q"], f"{venv_dvc} repro -q")
    assert _may_have_recorded([venv_dvc, "repro"], f"{venv_dvc} repro")
    assert _may_have_recorded(["python", "-m", "dvc", "repro"], "/site-packages/dvc/__main__.py repro")
    assert not _may_have_recorded(["sleep", "60"], "dvc add x")
    assert not _may_have_recorded(["/venv/bin/python", "/venv/bin/xbn", "serve"], f"{venv_dvc} repro")
    assert not _may_have_recorded(["python", "-m", "dvc", "push"], "/site-packages/dvc/__main__.py repro")
