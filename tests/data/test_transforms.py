"""build_transform: timm pipelines giving normalized tensors of the configured size."""

from __future__ import annotations

import torch
from PIL import Image

from xbn.data import build_transform

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)


def test_eval_resize_center_crop_and_normalize():
    image = Image.new("RGB", (50, 30), (255, 0, 51))
    out = build_transform(32, training=False, mean=MEAN, std=STD)(image)
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    expected = torch.tensor([(1.0 - 0.5) / 0.2, (0.0 - 0.4) / 0.25, (0.2 - 0.3) / 0.5])
    assert torch.allclose(out.mean(dim=(1, 2)), expected, atol=1e-4)


def test_training_pipeline_uses_randaugment_and_erasing_and_gives_the_size():
    transform = build_transform(24, training=True, mean=MEAN, std=STD)
    text = repr(transform)
    assert "RandomResizedCrop" in text and "RandAugment" in text and "RandomErasing" in text
    gray = Image.new("L", (40, 20), 90).convert("RGB")
    torch.manual_seed(0)
    outs = [transform(gray) for _ in range(4)]
    assert all(o.shape == (3, 24, 24) for o in outs)


def test_light_training_views_crop_and_flip_only():
    text = repr(build_transform(24, training=True, mean=MEAN, std=STD, augment="light"))
    assert "RandomResizedCrop" in text and "RandomHorizontalFlip" in text and "scale=(0.5, 1.0)" in text
    assert "RandAugment" not in text and "RandomErasing" not in text and "ColorJitter" not in text
