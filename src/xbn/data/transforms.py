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
        return create_transform(  # timm reads color_jitter=None as no jitter, but types it a float
            image_size, is_training=True, scale=LIGHT_SCALE, color_jitter=None,  # type: ignore[arg-type]
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


def _eval_steps(transform):
    """The four steps of an eval transform (`build_transform(..., training=False)`): resize, centre crop,
    to-tensor, normalise; a ValueError if `transform` is laid out otherwise (another timm might)."""
    from torchvision import transforms as T

    steps = list(getattr(transform, "transforms", ()))
    kinds = [type(s).__name__ for s in steps]
    if (len(steps) != 4 or not isinstance(steps[0], T.Resize) or not isinstance(steps[1], T.CenterCrop)
            or kinds[2] not in ("ToTensor", "MaybeToTensor") or not isinstance(steps[3], T.Normalize)):
        raise ValueError(f"not an eval transform (Resize, CenterCrop, ToTensor, Normalize): {kinds}")
    return steps


def eval_geometry(transform):
    """The resize and centre crop of an eval transform: RGB PIL image -> RGB PIL image of the model's input
    size; what remains (to-tensor: x / 255 in CHW; normalise: (x - mean) / std) is arithmetic on its pixels."""
    from torchvision import transforms as T

    return T.Compose(_eval_steps(transform)[:2])


def eval_resize_rule(transform) -> dict:
    """What `eval_geometry(transform)` does to an image of any size, in words another language can follow
    (torchvision's `resize` and `center_crop` on a PIL image, read from the transform's own settings)."""
    resize, crop = _eval_steps(transform)[:2]
    shorter = resize.size if isinstance(resize.size, int) else resize.size[0]
    if resize.max_size is not None or (not isinstance(resize.size, int) and len(resize.size) != 1):
        raise ValueError(f"not a shorter-side resize: {resize}")
    height, width = crop.size
    return {
        "resize": {
            "shorter_side": shorter,
            "longer_side": f"int({shorter} * longer / shorter): a float division, truncated",
            "interpolation": resize.interpolation.value,
            "antialias": True,  # PIL's bilinear always filters over the downscale factor
            "reference": f"PIL Image.resize((new_width, new_height), Image.{resize.interpolation.name}); an "
                         f"image whose sides already are the new ones is left as it is",
        },
        "center_crop": {
            "height": height,
            "width": width,
            "top": f"round((new_height - {height}) / 2)",
            "left": f"round((new_width - {width}) / 2)",
            "rounding": "half to even (Python's round)",
        },
    }
