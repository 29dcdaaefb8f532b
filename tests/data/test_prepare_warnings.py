"""A newcomer's small folder dataset (found replaying the README with 30 classes): `prepare` says when the
validation split is too small to choose the best epoch on, and is quiet when it is not."""

from __future__ import annotations

import logging

import pytest
from PIL import Image

from xbn.config import load_params
from xbn.stages.prepare import MIN_VAL_CLASSES, prepare


def folder_params(tmp_path, classes: int):
    root = tmp_path / "images"
    for c in range(classes):
        (root / f"c{c:02d}").mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (c * 7 % 256, i * 40, 0)).save(root / f"c{c:02d}" / f"{i}.png")
    return load_params(None, ["data.dataset=folder", f"data.root={root}", f"data.manifest={tmp_path / 'm.csv'}"])


@pytest.mark.parametrize(("classes", "warned"), [(16, True), (100, False)])
def test_a_validation_split_too_small_to_choose_on_is_said(tmp_path, caplog, classes, warned):
    with caplog.at_level(logging.WARNING, logger="xbn.stages.prepare"):
        summary = prepare(folder_params(tmp_path, classes))
    said = [r.getMessage() for r in caplog.records if "validation has" in r.getMessage()]
    assert (summary["val"]["classes"] < MIN_VAL_CLASSES) == warned
    assert bool(said) == warned, said
    if warned:
        assert f"validation has {summary['val']['classes']} classes" in said[0] and "data.val_classes" in said[0]
