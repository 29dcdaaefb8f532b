"""`make test` runs the suite on two xdist workers, and a module that starts servers (MLflow, Prefect, PostgreSQL
clusters) must run on one of them, or it starts them twice. pytest 9.2 reads a node's id from `_id` while
pytest-xdist 3.8 writes `xdist_group` into `_nodeid`, so `--dist loadgroup` silently stopped grouping. This runs a
tiny suite of two modules (marked with `xdist_group`, as ours are) with the Makefile's own `--dist` option and
checks that each module ran on a single worker."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODULE = '''
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("{name}")


@pytest.mark.parametrize("i", range(6))
def test_record(i):
    with open(Path(__file__).with_name("seen.txt"), "a") as fh:
        fh.write(f"{name} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
'''


def makefile_dist() -> list[str]:
    line = next(li for li in (ROOT / "Makefile").read_text().splitlines() if "-m pytest" in li)
    found = re.search(r"--dist[ =](\S+)", line)
    return ["--dist", found.group(1)] if found else []


def test_the_makefiles_distribution_keeps_each_module_on_one_worker(tmp_path):
    for name in ("servers_a", "servers_b"):
        (tmp_path / f"test_{name}.py").write_text(MODULE.format(name=name))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", *makefile_dist(), "-p", "no:cacheprovider",
                           "-p", "no:randomly", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = defaultdict(set)
    for line in (tmp_path / "seen.txt").read_text().splitlines():
        module, worker = line.split()
        workers[module].add(worker)
    assert set(workers) == {"servers_a", "servers_b"}
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
