"""The torchrun launches that tests/distributed shares: `xbn train --nproc 2` on one node, and
`xbn train --nnodes 2` as two "nodes" on 127.0.0.1 (1 process each, gloo, c10d rendezvous), all started at once
on the same data and params (each torchrun launch starts 3 processes that import torch: sharing them keeps the
suite fast; their tests share the xdist group `torchrun`, so that `make test`'s workers launch them once)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests_support import ROOT, TINY

# A memory that wraps around (36 rows, 4 global batches of 16) and whose AXBN Kalman state depends on the whole
# global batch: both must be the same on every rank for the runs to agree. 2 epochs (1 warm-up): the warm-up ->
# main switch re-wraps the model in DDP.
TORCHRUN_RUN = ["memory.method=axbn", "memory.size=36", "train.epochs=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_train(cwd: Path, overrides: list[str], *flags: str) -> subprocess.Popen:
    # One thread per process in every run: the same float operations in the same order (torchrun sets it only
    # for --nproc > 1), and no oversubscribed CPU.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    cwd.mkdir()
    return subprocess.Popen([sys.executable, "-m", "xbn.cli", "train", *flags, "--params", str(ROOT / "params.yaml"),
                             *(f"--set={o}" for o in overrides)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers: the session start_train began
        out, err = process.communicate()
    return process.returncode, out, err


@pytest.fixture(scope="session")
def torchrun_runs(glyph_root, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(base, stdout by run): runs in base/node0, base/node1 (the two nodes, each with its own folder: its
    relative train.checkpoint_dir is its own, nothing shared but the data) and base/single (--nproc 2)."""
    from xbn.config import load_params
    from xbn.stages.prepare import prepare

    base = tmp_path_factory.mktemp("torchrun")
    overrides = [*TINY, *TORCHRUN_RUN, f"data.root={glyph_root}", f"data.manifest={base / 'manifest.csv'}"]
    prepare(load_params(ROOT / "params.yaml", overrides))
    endpoint = f"127.0.0.1:{free_port()}"
    started = {f"node{r}": start_train(base / f"node{r}", overrides, "--nnodes", "2", "--node-rank", str(r),
                                       "--rdzv-endpoint", endpoint) for r in (0, 1)}
    started["single"] = start_train(base / "single", overrides, "--nproc", "2")
    done = {name: finish(p) for name, p in started.items()}
    for name, (code, _, err) in done.items():
        assert code == 0, f"{name}: {err[-3000:]}"
    return base, {name: out for name, (_, out, _) in done.items()}
