"""An index build replaces its output folder whole (issue 54 item 6): each builder writes a folder of its own,
renamed into place, so two builders of one `index.output` leave one builder's index, never a mix that its
index.json would certify, and a builder killed before the swap leaves the old index serving. Real processes,
paused or killed at the named fault point `index.before_swap` (index_builder.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xbn.serving.index import CatalogueIndex
from xbn.utils.io import atomic_folder

BUILDER = Path(__file__).with_name("index_builder.py")


def build(out: Path, tag: str, rows: int, fault: str = "", fault_dir: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "XBN_FAULT": fault, "XBN_FAULT_DIR": str(fault_dir or out.parent)}
    return subprocess.Popen([sys.executable, str(BUILDER), str(out), tag, str(rows)], env=env,
                            stderr=subprocess.PIPE, text=True)


def wait_reached(flag: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, f"{flag} never appeared"
        time.sleep(0.1)


def served(out: Path) -> tuple[str, int]:
    """Whose index `out` holds (its model tag, which every path starts with) and its rows: load verifies that
    index.json names the bytes of both other files."""
    index = CatalogueIndex.load(out)
    owners = {p.split("/")[0] for p in index.ids["path"]}
    assert owners == {index.meta["model_sha256"]}, owners  # one builder's ids, with that builder's index.json
    return index.meta["model_sha256"], index.count


def test_two_builders_of_one_output_leave_one_whole_index(tmp_path):
    out = tmp_path / "index"
    assert build(out, "old", 50).wait(120) == 0
    slow = build(out, "slow", 80, "index.before_swap:wait")
    wait_reached(tmp_path / "index.before_swap.reached", slow)  # its folder is complete, not yet in place
    assert served(out) == ("old", 50)
    fast = build(out, "fast", 120)
    assert fast.wait(120) == 0, fast.stderr.read()
    assert served(out) == ("fast", 120)
    (tmp_path / "index.before_swap.release").touch()
    assert slow.wait(120) == 0, slow.stderr.read()
    assert served(out) == ("slow", 80)  # the last to finish wins, whole
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".index.")] == []  # nothing left beside it


def test_a_builder_killed_before_the_swap_leaves_the_old_index_and_the_next_clears_its_folder(tmp_path):
    out = tmp_path / "index"
    assert build(out, "old", 50).wait(120) == 0
    killed = build(out, "killed", 80, "index.before_swap:kill")
    assert killed.wait(120) == -9
    assert served(out) == ("old", 50)
    assert len([p for p in tmp_path.iterdir() if p.name.endswith(".building")]) == 1  # the dead builder's
    assert build(out, "next", 60).wait(120) == 0
    assert served(out) == ("next", 60)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".index.")] == []


def test_a_folder_put_aside_by_a_killed_swap_comes_back(tmp_path):
    """Killed between the swap's two renames: the output is gone and the old folder sits aside under a dead
    process's name. The next writer of that output puts it back before anything else (and a failed write then
    leaves it in place)."""
    out = tmp_path / "index"
    out.mkdir()
    (out / "kept.txt").write_text("the old index")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    import socket

    out.rename(tmp_path / f".index.{socket.gethostname()}.{dead}.0123abcd.old")
    with pytest.raises(RuntimeError, match="build failed"), atomic_folder(out) as building:
        (building / "half.txt").write_text("half")
        raise RuntimeError("build failed")
    assert (out / "kept.txt").read_text() == "the old index" and not (out / "half.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]
