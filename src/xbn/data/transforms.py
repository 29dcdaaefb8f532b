"""Image transforms built with timm's `create_transform`, so augmentation matches the published recipes."""

from __future__ import annotations

from collections.abc import Sequence

from timm.data import create_transform

# The recipe of seed 000: RandAugment magnitude 9 (std 0.5) and random erasing with probability 0.2.
AUTO_AUGMENT = "rand-m9-mstd0.5"
RE_PROB = 0.2


def build_transform(
    image_size: int,
    training: bool,
    mean: Sequence[float],
    std: Sequence[float],
    crop_pct: float | None = None,
):
    """RGB PIL image -> normalized `(3, image_size, image_size)` float tensor.

    Training: random-resized crop, horizontal flip, RandAugment, normalization, random erasing. Evaluation:
    resize to `image_size / crop_pct` (timm's default crop_pct 0.875 when None) and center-crop to
    `image_size`. Inputs must already be RGB (`ImageDataset` converts grayscale).
    """
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
