"""A training process killed with SIGKILL mid-run loses nothing: `xbn train --resume` finishes it with the
same weights and metrics as a run that was never interrupted."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from xbn.cli import main

XBN = str(Path(sys.executable).with_name("xbn"))


def _weights(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state["state_dict"] if "state_dict" in state else state["model"]  # model.pt | last.pt


def test_kill_9_mid_epoch_then_resume_equals_the_uninterrupted_run(params_file, tmp_path, caplog):
    # Three epochs (one warm-up): the kill lands after the first checkpoint, before the end.
    params = str(params_file("memory.method=xbm"))
    assert main(["prepare", "--params", params, "-q"]) == 0
    killed = ["--set", "train.checkpoint_dir=part", "--set", "train.metrics_dir=part_metrics"]
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen([XBN, "train", "--params", params, "-q", *killed], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    threads = torch.get_num_threads()
    try:
        # The uninterrupted reference trains here meanwhile (both processes use one thread: the same kernels).
        torch.set_num_threads(1)
        assert main(["train", "--params", params, "-q", "--set", "train.checkpoint_dir=full",
                     "--set", "train.metrics_dir=full_metrics"]) == 0
        last = tmp_path / "part/last.pt"
        deadline = time.monotonic() + 120
        while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert last.exists(), (tmp_path / "killed.log").read_text()[-3000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        log.close()
        torch.set_num_threads(threads)
    assert proc.returncode == -signal.SIGKILL
    interrupted_at = torch.load(last, map_location="cpu", weights_only=True)["epoch"]
    assert 1 <= interrupted_at < 3, "the kill came too late to interrupt anything"

    torch.set_num_threads(1)
    try:
        with caplog.at_level(logging.INFO, logger="xbn.training.trainer"):
            assert main(["train", "--params", params, "-q", "--resume", *killed]) == 0
    finally:
        torch.set_num_threads(threads)
    # It continued from the checkpoint (a fresh start would reach the same weights, only slower).
    assert f"at epoch {interrupted_at}" in caplog.text

    def summary(folder: str) -> dict:
        data = json.loads((tmp_path / folder / "train.json").read_text())
        data.pop("train_seconds")  # wall time, the one thing allowed to differ
        return data

    assert summary("part_metrics") == summary("full_metrics")
    assert summary("full_metrics")["epochs"] == 3
    assert (tmp_path / "part_metrics/train_epochs.csv").read_text() == \
        (tmp_path / "full_metrics/train_epochs.csv").read_text()
    for name in ("model.pt", "last.pt"):
        full, resumed = _weights(tmp_path / "full" / name), _weights(tmp_path / "part" / name)
        assert full.keys() == resumed.keys()
        for key in full:
            torch.testing.assert_close(resumed[key], full[key], rtol=0, atol=0, msg=f"{name}: {key}")
