"""The newcomer's session (issue 26), replayed from a fresh folder outside the repository: a folder dataset of
real PNG files, `xbn init`, `xbn run`, then `xbn summary`, `xbn registry review` and `xbn search`. Each output
must name the folder dataset and the params the run really had, not the glyph defaults."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
from PIL import Image

from tests_support import ROOT


# The smallest model and run that still trains, evaluates, registers and indexes.
TINY_INIT = ["data.image_size=32", "data.num_workers=0", "data.val_classes=0.25",
             "model.backbone=test_efficientnet", "model.pretrained=none", "model.embedding_dim=16",
             "memory.method=none", "train.epochs=1", "train.warmup_epochs=0", "train.batch_size=16",
             "train.samples_per_class=4", "train.probe_size=8", "loss.miner=null", "eval.k=[1, 2, 4]",
             "eval.embedding_space=false", "eval.baseline=false", "index.recall_queries=8"]


def shapes(root, classes: int = 16, per_class: int = 4) -> None:
    """`root/<class>/<i>.png`: each class a colour, each image that colour with its own noise."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        colour = rng.integers(0, 256, 3)
        (root / f"shape{c:02d}").mkdir(parents=True)
        for i in range(per_class):
            pixels = np.clip(colour + rng.normal(0, 12, (32, 32, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / f"shape{c:02d}" / f"{i}.png")


def xbn(cwd, *args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k != "XBN_PARENT_RUN_ID"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "xbn.cli", *args], cwd=cwd, env=env, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=600)


def test_a_newcomer_runs_a_folder_dataset_end_to_end_from_their_own_folder(tmp_path):
    data, work = tmp_path / "my-shapes", tmp_path / "project"
    shapes(data)
    work.mkdir()
    assert not str(work).startswith(str(ROOT))

    init = xbn(work, "init", "--dataset", "folder", "--root", str(data), *(f"--set={s}" for s in TINY_INIT))
    assert init.returncode == 0, init.stderr
    assert "folder" in init.stdout and (work / "params.yaml").exists()

    run = xbn(work, "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("xbn: summary") and "{" not in run.stdout  # the summary, not JSON
    for text in (run.stdout, (summary := xbn(work, "summary")).stdout):
        assert f"folder at {data}" in text and re.search(r"memory +none; batch 16 \(4 classes x 4\)", text)
        assert "v1 promoted" in text and "glyphs" not in text
    assert summary.returncode == 0
    assert (work / "models/index/index.faiss").exists()  # index ran too, attached to v1

    review = xbn(work, "registry", "review")
    assert review.returncode == 0, review.stderr
    assert "folder:my-shapes" in review.stdout and "none" in review.stdout and "16 (4x4)" in review.stdout
    assert review.stdout.startswith("xbn-embedder\n")  # the table itself, not a JSON string of it

    search = xbn(work, "search", str(data / "shape03" / "0.png"), "--k", "3")
    assert search.returncode == 0, search.stderr
    assert "xbn-embedder v1 (champion)" in search.stdout and "shape" in search.stdout

    # A later stage's --set that contradicts the run is refused in one line, before any work.
    refused = xbn(work, "register", "--set", "memory.method=axbn")
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0 and "memory.method" in refused.stderr

    # `xbn summary | head`: a reader that closes the pipe gets no traceback.
    read, write = os.pipe()
    os.close(read)
    try:
        closed = xbn(work, "summary", stdout=write)
    finally:
        os.close(write)
    assert closed.returncode == 0 and "Traceback" not in closed.stderr
