"""ONNX export of the served embedder: uint8 pixels in, parity with torch on real images, any batch size,
metadata and the preprocessing rule beside the file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from xbn.evaluation.onnx_export import (
    ParityError,
    check_parity,
    export_onnx,
    onnx_embed,
    onnx_metadata,
    rule_path,
)


@pytest.fixture(scope="module")
def exported(served, tmp_path_factory):
    return export_onnx(served, tmp_path_factory.mktemp("onnx") / "model.onnx")


def test_parity_with_torch_on_real_images(served, exported, image_root):
    images = sorted(image_root.rglob("*.png"))  # 24 images: grey and RGB files, batch 24
    assert check_parity(served, exported, images) <= 1e-4
    assert check_parity(served, exported, images[:1]) <= 1e-4  # batch 1 through the same graph


def test_batch_axis_is_dynamic_and_output_unit_norm(exported):
    for n in (1, 3, 7):
        out = onnx_embed(exported, np.random.default_rng(n).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8))
        assert out.shape == (n, 16)
        np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)


def test_metadata_says_how_to_feed_it(served, exported):
    meta = onnx_metadata(exported)
    assert meta["image_size"] == 32 and meta["embedding_dim"] == 16 and meta["model_sha256"] == served.sha256
    assert meta["mean"] == pytest.approx(list(served.data_config["mean"]))
    rule = json.loads(rule_path(exported).read_text())
    assert rule["input"] == {"name": "images", "dtype": "uint8", "shape": ["N", 32, 32, 3], "layout": "NHWC",
                             "channels": "RGB"}
    # timm's eval transform at 32 px: shorter side to floor(32 / 0.875) = 36, bilinear, centre crop 32
    assert rule["resize"]["shorter_side"] == 36 and rule["resize"]["interpolation"] == "bilinear"
    assert (rule["center_crop"]["height"], rule["center_crop"]["width"]) == (32, 32)
    assert rule["decode"]["background"] == [255, 255, 255]
    assert rule["output"] == {"name": "embeddings", "dtype": "float32", "shape": ["N", 16], "l2_normalized": True}
    assert rule["model_sha256"] == served.sha256 and len(rule["onnx_sha256"]) == 64


def test_float_input_is_refused_by_name(exported):
    with pytest.raises(ValueError, match="takes uint8 pixels"):
        onnx_embed(exported, np.zeros((1, 32, 32, 3), dtype=np.float32))


def test_parity_fails_for_another_model(exported, other_model_path, image_root):
    from xbn.serving.model import load_served_model

    other = load_served_model(other_model_path, 32)
    with pytest.raises(ParityError, match="differ from torch"):
        check_parity(other, exported, sorted(image_root.rglob("*.png"))[:4])
