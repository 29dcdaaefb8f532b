"""Warm start (issue 24 item 3): `train.init` a trained model.pt fine-tunes it for train.finetune_epochs with no
head warm-up, starting from exactly its weights, and the new model.pt records its parent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from xbn.config import ConfigError
from xbn.stages.prepare import prepare
from xbn.stages.train import train


def test_fine_tuning_starts_from_the_given_weights_and_records_its_parent(tiny_params, tmp_path):
    first = tiny_params()
    prepare(first)
    result = train(first, progress=False)
    # The stage's result: the report as a dict, where the outputs are, and the selected model on demand.
    written = json.loads((tmp_path / "metrics/train.json").read_text())
    assert isinstance(result, dict) and result == {k: v for k, v in written.items() if k != "train_seconds"}
    assert result.model_path == Path("models/model.pt") and result.best_epoch == result["best_epoch"]
    assert result.load_model().embedding_dim == first.model.embedding_dim
    parent = tmp_path / "parent"
    shutil.copytree("models", parent)
    parent_state = torch.load(parent / "model.pt", weights_only=True)
    parent_val = parent_state["metrics"]["val_recall@1"]

    tuned = tiny_params(f"train.init={parent / 'model.pt'}", "train.finetune_epochs=1")
    assert (tuned.train.warmup_epochs, tuned.train.epochs) == (0, 1)  # no head warm-up, finetune_epochs
    summary = train(tuned, progress=False)
    assert summary["epochs"] == 1
    epochs = (tmp_path / "metrics/train_epochs.csv").read_text().splitlines()
    # Epoch 0 is the untrained score: here the parent's weights, so the parent's val R@1 (same val split).
    untrained = float(epochs[1].split(",")[epochs[0].split(",").index("val_recall@1")])
    assert untrained == pytest.approx(parent_val, abs=1e-6)
    child = torch.load(tmp_path / "models/model.pt", weights_only=True)
    assert child["init"] == {"from": str(parent / "model.pt"), "version": None,
                             "model_sha256": (parent / "model.pt.sha256").read_text().split()[0]}

    # Zero fine-tuning epochs: the model is the parent, weight for weight.
    shutil.rmtree("models")
    train(tiny_params(f"train.init={parent / 'model.pt'}", "train.finetune_epochs=0"), progress=False)
    same = torch.load(tmp_path / "models/model.pt", weights_only=True)["state_dict"]
    assert same.keys() == parent_state["state_dict"].keys()
    assert all(torch.equal(same[k], parent_state["state_dict"][k]) for k in same)


def test_weights_of_another_shape_or_a_missing_file_are_refused_before_training(tiny_params, tmp_path):
    prepare(tiny_params())
    train(tiny_params(), progress=False)
    shutil.copy("models/model.pt", tmp_path / "parent.pt")
    shutil.copy("models/model.pt.sha256", tmp_path / "parent.pt.sha256")
    with pytest.raises(ConfigError, match=r"model.embedding_dim=16, the params ask for 32"):
        train(tiny_params(f"train.init={tmp_path / 'parent.pt'}", "model.embedding_dim=32"), progress=False)
    with pytest.raises(ConfigError, match="no such file"):
        train(tiny_params(f"train.init={tmp_path / 'missing.pt'}"), progress=False)
    with pytest.raises(ConfigError, match="needs tracking.enabled"):
        train(tiny_params("train.init=champion"), progress=False)
