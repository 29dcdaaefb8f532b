"""An image that turns bad after `validate` passed (truncated or deleted on disk) is skipped, counted and
named by training and evaluation instead of crashing them; its batch is just smaller."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from tests_support import recomputed_recall_at_1
from xbn.data.dataset import ImageDataset, collate_skipping
from xbn.stages.evaluate import evaluate
from xbn.stages.prepare import prepare
from xbn.training.trainer import Trainer


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:60])  # the PNG header survives, the pixels do not


def test_collate_drops_skipped_samples(tmp_path):
    good = tmp_path / "good.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(good)
    shutil.copy(good, tmp_path / "bad.png")
    _truncate(tmp_path / "bad.png")
    frame = pd.DataFrame({"path": ["good.png", "bad.png", "gone.png"], "label": ["a", "a", "b"]})
    data = ImageDataset(frame, tmp_path, skip_unreadable=True)
    images, labels, indices = collate_skipping([data[i] for i in range(3)])
    assert images.shape == (1, 3, 8, 8) and indices.tolist() == [0]
    images, labels, indices = collate_skipping([data[1], data[2]])
    assert images.numel() == 0 and labels.dtype == indices.dtype == torch.long and len(indices) == 0


def test_training_and_evaluation_skip_and_name_images_that_went_bad(tiny_params, glyph_root, tmp_path,
                                                                      caplog, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("XBN_PARENT_RUN_ID", raising=False)
    root = tmp_path / "glyphs"
    shutil.copytree(glyph_root, root)  # the session's glyphs stay intact for the other tests
    params = tiny_params(f"data.root={root}", "train.warmup_epochs=0", "train.epochs=1",
                         "eval.baseline=false")
    prepare(params)  # validated and listed; the files go bad afterwards
    manifest = pd.read_csv(params.data.manifest)
    train_paths = manifest.loc[manifest["split"] == "train", "path"].tolist()
    test_path = manifest.loc[manifest["split"] == "test", "path"].iloc[0]
    _truncate(root / train_paths[0])
    (root / train_paths[5]).unlink()
    _truncate(root / test_path)

    trainer = Trainer(params, progress=False)
    trainer.sampler.set_epoch(0)  # which rows the one epoch draws (class-balanced: not every row)
    drawn = {index for batch in trainer.sampler for index, _ in batch}
    expected = sorted(train_paths[i] for i in {0, 5} & (drawn | _probed(params, len(train_paths))))
    assert expected, "the epoch draws neither bad image"
    with caplog.at_level(logging.WARNING, logger="xbn.training.trainer"):
        summary = trainer.fit()
    assert summary["skipped_images"] == len(expected) and summary["iterations"] == len(trainer.sampler)
    assert json.loads(Path("metrics/train.json").read_text())["skipped_images"] == len(expected)
    assert trainer.history.skipped == expected and all(p in caplog.text for p in expected)

    caplog.clear()
    # Tracked, so the retrieval grid (rows paired with embeddings) is drawn without the skipped image.
    params.tracking.enabled, params.tracking.uri = True, f"sqlite:///{tmp_path / 'mlflow.db'}"
    with caplog.at_level(logging.WARNING):
        metrics = evaluate(params)
    written = json.loads(Path(params.eval.output).read_text())
    assert written["num_skipped_images"] == 1 and "skipped_images" not in written
    assert test_path in caplog.text
    # Scored over the readable test images only: the R@1 of a brute-force pass that leaves the bad one out.
    assert metrics["num_queries"] == (manifest["split"] == "test").sum() - 1
    assert metrics["recall@1"] == pytest.approx(recomputed_recall_at_1(params, "test"), abs=1e-12)
    assert Path("plots/retrieval_grid.png").stat().st_size > 0


def _probed(params, n: int) -> set[int]:
    """The training rows (by position in the split) of the drift probe: train.probe_size spread evenly."""
    return set(np.linspace(0, n - 1, min(params.train.probe_size, n)).astype(int).tolist())


def test_an_image_the_probe_cannot_read_is_named_by_manifest_row_and_counted(tiny_params, glyph_root, tmp_path,
                                                                             caplog):
    root = tmp_path / "glyphs"
    shutil.copytree(glyph_root, root)
    params = tiny_params(f"data.root={root}")
    prepare(params)
    manifest = pd.read_csv(params.data.manifest)
    train = manifest[manifest["split"] == "train"]
    position = max(_probed(params, len(train)))  # the last probe image: its split index is not its row
    row, path = train.index[position], train["path"].iloc[position]
    assert row != position
    _truncate(root / path)
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(params, progress=False)
    assert f"skipping manifest row {row} ({path})" in caplog.text
    assert (f"drift probe (train.probe_size): 1 unreadable image(s) left out, manifest row(s) {row}: {path}"
            in caplog.text)
    assert len(trainer.probe) == len(_probed(params, len(train))) - 1
    assert trainer.history.skipped == [path] and trainer.summary()["skipped_images"] == 1
