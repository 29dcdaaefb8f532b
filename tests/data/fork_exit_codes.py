"""Run by tests/data/test_dataset.py in a fresh interpreter: `python fork_exit_codes.py ROOT` prints, as JSON, what
a pass over a plain DataLoader and over xbn's loader yields from ROOT's csv dataset, and their workers' exit codes,
while the parent holds a thread-exit hook that fails in a forked child (what a Prefect flow run leaves: its log
and event services drain their queue in one, `threading._register_atexit`).

A fresh interpreter because a forked worker inherits all its parent holds. Inside `make test`'s pytest worker that
is whatever earlier test modules left (threads, signal handlers, exit hooks): there one plain worker once never
exited (exit code None after the DataLoader's own terminate and a 30 s join), which says nothing about xbn.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading

import numpy as np
import torch
from torch.utils.data import DataLoader

from xbn.data import ImageDataset, read_dataset
from xbn.evaluation.embed import image_loader


def worker_exit_codes(loader) -> tuple[list[int], list[int | None]]:
    """The dataset indices a pass yielded and the workers' exit codes, read directly: the DataLoader reports a
    dead worker only if its SIGCHLD lands while the main process waits."""
    batches = iter(loader)
    seen: list[int] = []
    try:
        for *_, index in batches:
            seen.extend(index.tolist())
    except RuntimeError as exc:
        assert "exited unexpectedly with exit code 1" in str(exc), exc
    for worker in batches._workers:
        worker.join(timeout=30)
    return sorted(seen), [w.exitcode for w in batches._workers]


def main(root: str) -> None:
    parent = os.getpid()

    def drain():
        assert os.getpid() == parent, "the parent's hook ran in a forked child"

    threading._register_atexit(drain)
    frame = read_dataset("csv", root)
    plain = DataLoader(ImageDataset(frame, root), batch_size=4, num_workers=2, multiprocessing_context="fork")
    ours = image_loader(frame, root, np.arange(len(frame)), None, batch_size=4, num_workers=2,
                        device=torch.device("cpu"))
    ours.multiprocessing_context = multiprocessing.get_context("fork")  # the Linux default, made explicit
    print(json.dumps({"plain": worker_exit_codes(plain), "xbn": worker_exit_codes(ours)}))


if __name__ == "__main__":
    main(sys.argv[1])
