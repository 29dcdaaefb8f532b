"""The embedder: unit-norm float32 output, frozen BatchNorm, parameter groups, checkpoint round trip."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from torch import nn

from xbn.config import ModelConfig
from xbn.models import backbone as bb
from xbn.models.embedder import CHECKPOINT_FORMAT, Embedder, build_embedder, load_embedder, save_embedder

DIM = 32


@pytest.fixture(scope="module")
def built():
    cfg = ModelConfig(embedding_dim=DIM)  # default: tf_efficientnet_lite0 with the offline weights
    embedder, data_config = build_embedder(cfg)
    return embedder, data_config, cfg


@pytest.fixture
def images():
    return torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))


def _batchnorms(model: nn.Module) -> list[nn.BatchNorm2d]:
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]


def test_output_is_unit_norm_float32(built, images):
    embedder, _, _ = built
    with torch.no_grad():
        out = embedder.eval()(images)
    assert out.shape == (4, DIM) and out.dtype == torch.float32
    torch.testing.assert_close(out.norm(dim=1), torch.ones(4))


def test_output_is_float32_under_autocast(built, images):
    embedder, _, _ = built
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = embedder.eval()(images)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.norm(dim=1), torch.ones(4))


def test_batchnorm_stays_frozen_in_train_mode(built, images):
    embedder, _, _ = built
    embedder.train()
    bns = _batchnorms(embedder)
    assert bns and embedder.training and embedder.head.training
    assert not any(bn.training for bn in bns)
    assert not any(p.requires_grad for bn in bns for p in bn.parameters())
    before = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in bns]
    embedder(images).sum().backward()
    embedder.zero_grad(set_to_none=True)
    for bn, (mean, var) in zip(bns, before):
        assert torch.equal(bn.running_mean, mean) and torch.equal(bn.running_var, var)


def test_batchnorm_trains_without_freeze_bn(images):
    backbone = timm.create_model("tf_efficientnet_lite0", num_classes=0)
    embedder = Embedder(backbone, DIM, freeze_bn=False).train()
    bn = _batchnorms(embedder)[0]
    before = bn.running_mean.clone()
    with torch.no_grad():
        embedder(images)
    assert bn.training and bn.weight.requires_grad and not torch.equal(bn.running_mean, before)


def test_parameter_groups_and_backbone_freezing(built):
    embedder, _, _ = built
    head = {id(p) for p in embedder.head_parameters()}
    backbone = {id(p) for p in embedder.backbone_parameters()}
    bn = {id(p) for m in _batchnorms(embedder) for p in m.parameters()}
    assert head.isdisjoint(backbone) and backbone.isdisjoint(bn)
    assert head | backbone | bn == {id(p) for p in embedder.parameters()}
    try:
        embedder.set_backbone_trainable(False)
        assert not any(p.requires_grad for p in embedder.backbone.parameters())
        assert all(p.requires_grad for p in embedder.head_parameters())
        embedder.set_backbone_trainable(True)
        assert all(p.requires_grad for p in embedder.backbone_parameters())
        assert not any(p.requires_grad for m in _batchnorms(embedder) for p in m.parameters())
    finally:
        embedder.set_backbone_trainable(True)


def test_save_load_round_trip_without_offline_weights(built, images, tmp_path, monkeypatch):
    embedder, data_config, cfg = built
    path = tmp_path / "embedder.pt"
    save_embedder(path, embedder, cfg, data_config, extra={"epoch": 3, "metrics": {"R@1": 0.5}})

    def no_offline(name):
        raise AssertionError("load_embedder must not read the offline weights")

    monkeypatch.setattr(bb, "offline_weights_path", no_offline)
    loaded, loaded_config, checkpoint = load_embedder(path)
    assert not loaded.training and loaded.freeze_bn
    assert loaded_config == data_config
    assert checkpoint["format"] == CHECKPOINT_FORMAT and checkpoint["model"] == cfg.model_dump()
    assert checkpoint["epoch"] == 3 and checkpoint["metrics"] == {"R@1": 0.5}
    with torch.no_grad():
        assert torch.equal(loaded(images), embedder.eval()(images))


def test_load_refuses_a_bare_state_dict(built, tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(built[0].state_dict(), path)
    with pytest.raises(ValueError, match="not an xbn embedder checkpoint: format None"):
        load_embedder(path)


def test_load_refuses_a_non_torch_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ValueError, match="not an xbn embedder checkpoint"):
        load_embedder(path)


def test_save_refuses_what_weights_only_cannot_load(built, tmp_path):
    embedder, data_config, cfg = built
    with pytest.raises(TypeError, match=r"checkpoint\.metrics\.R@1 is a float64"):
        extra = {"metrics": {"R@1": np.float64(0.5)}}
        save_embedder(tmp_path / "a.pt", embedder, cfg, data_config, extra=extra)
    with pytest.raises(ValueError, match="overwrite"):
        save_embedder(tmp_path / "b.pt", embedder, cfg, data_config, extra={"state_dict": {}})
    assert not list(tmp_path.iterdir())
