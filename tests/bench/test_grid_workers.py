"""A grid stopped with `kill` takes its pool's workers with it: before, they trained to the end of their runs,
beside whatever was measured next (seen: two orphaned Omniglot runs halving a grid's speed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests_support import ROOT

pytestmark = pytest.mark.slow  # two pools of spawned workers: seconds, not a unit test

POOL = """
import concurrent.futures as futures, multiprocessing, os, sys, time
from benchmarks.grid import exit_with_parent

def job():
    print(os.getpid(), flush=True)
    time.sleep(120)

if __name__ == "__main__":
    initializer = exit_with_parent if sys.argv[1] == "watched" else None
    with futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=initializer,
                                     initargs=(os.getpid(), 0.2) if initializer else ()) as pool:
        pool.submit(job).result()
"""


def _worker_left_after_killing_its_grid(script, mode: str, wait_s: float) -> bool:
    grid = subprocess.Popen([sys.executable, str(script), mode], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    worker = int(grid.stdout.readline())
    grid.kill()
    grid.wait()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.2)
    os.kill(worker, 9)
    return True


def test_a_killed_grid_leaves_no_worker_training(tmp_path):
    script = tmp_path / "grid.py"  # a file: spawn's workers import the job from it
    script.write_text(POOL)
    assert not _worker_left_after_killing_its_grid(script, "watched", wait_s=10)
    assert _worker_left_after_killing_its_grid(script, "unwatched", wait_s=2)  # what it guards against: the worker outlives it
