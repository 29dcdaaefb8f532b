"""Dask's nanny starts every worker with MALLOC_TRIM_THRESHOLD_=65536, which switched off glibc's dynamic mmap
threshold and made a shard's embedding 2.5x slower (issue 29's catalogue benchmark); the catalogue task undoes it.
Run in fresh interpreters: the variable is read by glibc at start-up, and the undo is once per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests_support import ROOT

PROBE = "from xbn.utils import cpu; print(cpu.restore_malloc_thresholds())"


def run(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"} | extra_env
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_dask_worker_s_fixed_trim_threshold_is_undone():
    assert run({"MALLOC_TRIM_THRESHOLD_": "65536"}) == "True"


def test_nothing_changes_without_the_variable():
    assert run({}) == "False"

