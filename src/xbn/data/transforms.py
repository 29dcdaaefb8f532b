"""Image transforms built with timm's `create_transform`, so augmentation matches the published recipes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from timm.data import create_transform

# The recipe of seed 000: RandAugment magnitude 9 (std 0.5) and random erasing with probability 0.2.
AUTO_AUGMENT = "rand-m9-mstd0.5"
RE_PROB = 0.2
LIGHT_SCALE = (0.5, 1.0)  # `augment="light"`: the crop's area range (timm's full recipe: 0.08 to 1)


def build_transform(
    image_size: int,
    training: bool,
    mean: Sequence[float],
    std: Sequence[float],
    crop_pct: float | None = None,
    augment: Literal["full", "light"] = "full",
):
    """RGB PIL image -> normalized `(3, image_size, image_size)` float tensor.

    Training (`augment` full): random-resized crop, horizontal flip, RandAugment, normalization, random erasing.
    `light`: a random-resized crop of half the image or more and the flip only (no RandAugment, colour jitter or
    erasing), for views that stay close to the evaluation images (the refiner's training views). Evaluation:
    resize to `image_size / crop_pct` (timm's default crop_pct 0.875 when None) and center-crop to
    `image_size`. Inputs must already be RGB (`ImageDataset` converts grayscale).
    """
    if training and augment == "light":
        return create_transform(image_size, is_training=True, scale=LIGHT_SCALE, color_jitter=None,
                                mean=tuple(mean), std=tuple(std))
    if training:
        return create_transform(
            image_size,
            is_training=True,
            auto_augment=AUTO_AUGMENT,
            re_prob=RE_PROB,
            mean=tuple(mean),
            std=tuple(std),
        )
    return create_transform(
        image_size, is_training=False, crop_pct=crop_pct, mean=tuple(mean), std=tuple(std)
    )
