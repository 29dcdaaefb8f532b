"""The training and evaluation transforms on uint8 image tensors (torchvision.transforms.v2), for images read from
the decode cache (`xbn.data.cache`): the PIL recipe of `xbn.data.transforms.build_transform`, step for step.

A training sample is augmented in two stages:
- per sample (`TensorAugment.sample`, in the DataLoader worker, under the sample's own seed from
  `SeededSamples`): random-resized crop and horizontal flip of the cached image (uint8 `(3, S, S)`), then the
  draws of the rest: RandAugment's two operations with their magnitudes, and the random-erasing box, all from
  torch's CPU generator;
- per batch (`TensorAugment.color_batch`), with no randomness left: the drawn operations applied to the batch
  (samples grouped by operation and magnitude, one call of torchvision's functional op per group), conversion to
  float, normalisation, erasing. It runs in the loader's worker as the collate step (`data.augment_on: loader`)
  or on the training device (`device`): the same code on the same draws, so the results differ only by the
  device's own rounding. A sample's result depends on its seed alone, not on the batch it lands in (every op is
  per image), the worker that loads it or where the batch stage runs.

Against timm's recipe (`create_transform(auto_augment="rand-m9-mstd0.5", re_prob=0.2)`, the PIL reference):
- random-resized crop: same scale (0.08, 1) and ratio (3/4, 4/3) ranges and bilinear interpolation, but of the
  cached image (shorter side resized to the eval size first, `xbn.data.cache`), not of the decoded original:
  a crop of an original larger than the cache is upsampled from fewer pixels (a little softer), and an
  original smaller than the cache went through one extra resize;
- RandAugment: timm's rand-m9 re-done on tensors with torchvision's functional ops: its 15 operations
  (torchvision's v2.RandAugment has 14 others: Identity, no Invert or SolarizeAdd), two drawn with replacement,
  each applied with probability 0.5, timm's magnitudes at level 9 (enhance factor 1.72 never negated,
  posterize to 3 bits, solarize from 230, translate 40.5% of the side, rotate 27 degrees, shear 0.27, signed
  at random), fill with the mean colour. Not the same: timm's magnitude noise (mstd 0.5: a level drawn around 9
  for every operation) is left out, so that samples with the same operation share one call; geometric
  operations interpolate nearest (torchvision's RandAugment's choice), timm's bilinear or bicubic at random;
  translations are whole pixels. torchvision's own v2.RandAugment(num_ops=2, magnitude=9) was tried first and
  left: it always applies both operations, negates the enhance factors and solarizes from 25, which made the
  augmented glyph images ~0.15 darker (normalised units) than timm's; this recipe matches the reference's
  per-channel mean and std within 0.02 (tests/data/test_cache.py measures it);
- random erasing: timm's (probability 0.2, area 2% to 1/3, aspect 0.3 to 3.3, 10 attempts, one box, filled
  with 0 after normalisation: `const` mode), re-implemented here on torch's generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from xbn.data.transforms import LIGHT_SCALE, RE_PROB

SCALE = (0.08, 1.0)  # timm's random-resized crop: area range
RATIO = (3 / 4, 4 / 3)
ERASE_AREA = (0.02, 1 / 3)  # timm's RandomErasing defaults
ERASE_ASPECT = (0.3, 1 / 0.3)


def to_float(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 `(..., 3, H, W)` -> normalised float32, as `to_tensor` then `Normalize` compute it (x / 255, then
    (x - mean) / std), so equal uint8 pixels give bit-identical floats."""
    # in place after the conversion: the same values as out of place, one buffer instead of two (half the time)
    return images.float().div_(255).sub_(mean.view(3, 1, 1)).div_(std.view(3, 1, 1))


def erase_box(height: int, width: int, probability: float) -> tuple[int, int, int, int] | None:
    """timm's RandomErasing box (one, `const` mode), drawn from torch's generator: (top, left, h, w) or None."""
    if probability <= 0 or torch.rand(()).item() >= probability:
        return None
    area = height * width
    log_ratio = (math.log(ERASE_ASPECT[0]), math.log(ERASE_ASPECT[1]))
    for _ in range(10):
        target = area * torch.empty(()).uniform_(*ERASE_AREA).item()
        aspect = math.exp(torch.empty(()).uniform_(*log_ratio).item())
        h, w = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if w < width and h < height:
            top = int(torch.randint(0, height - h + 1, ()).item())
            left = int(torch.randint(0, width - w + 1, ()).item())
            return top, left, h, w
    return None


# timm's RandAugment operations (timm.data.auto_augment._RAND_TRANSFORMS, rand-m9) at magnitude `magnitude` of
# its 10 levels, for a (height, width) image: (name, magnitude or None, signed). Index 0 is no operation (an
# operation that its coin skipped).
def randaugment_space(magnitude: float, height: int, width: int) -> list[tuple[str, float | None, bool]]:
    level = magnitude / 10  # timm's _LEVEL_DENOM
    return [
        ("Identity", None, False),
        ("AutoContrast", None, False),
        ("Equalize", None, False),
        ("Invert", None, False),
        ("Rotate", 30.0 * level, True),
        ("Posterize", float(int(level * 4)), False),  # bits kept (timm's _posterize_level_to_arg)
        ("Solarize", float(min(256, int(level * 256))), False),  # threshold: pixels at or above it inverted
        ("SolarizeAdd", float(min(128, int(level * 110))), False),  # added below 128
        # timm's enhance factor level * 1.8 + 0.1 (1.72 at m9), never negated in rand-m9 (its `Increasing`
        # variants, with a random sign, are other recipes); apply_op's factor is 1 + magnitude
        ("Color", level * 1.8 + 0.1 - 1.0, False),
        ("Contrast", level * 1.8 + 0.1 - 1.0, False),
        ("Brightness", level * 1.8 + 0.1 - 1.0, False),
        ("Sharpness", level * 1.8 + 0.1 - 1.0, False),
        ("ShearX", 0.3 * level, True),
        ("ShearY", 0.3 * level, True),
        ("TranslateXRel", 0.45 * level * width, True),
        ("TranslateYRel", 0.45 * level * height, True),
    ]


def apply_op(images: torch.Tensor, name: str, magnitude: float, fill: list[int]) -> torch.Tensor:
    """One RandAugment operation on a uint8 `(..., 3, H, W)` batch, with torchvision's functional ops (nearest
    interpolation for the geometric ones, as torchvision's RandAugment; timm's PIL ops pick bilinear or bicubic
    at random)."""
    nearest = v2.InterpolationMode.NEAREST
    if name == "Identity":
        return images
    if name in ("ShearX", "ShearY"):  # timm: the affine (1, m, 0, 0, 1, 0) about the corner
        shear = math.degrees(math.atan(magnitude))
        return TF.affine(images, angle=0.0, translate=[0, 0], scale=1.0, interpolation=nearest, fill=fill,
                         shear=[shear, 0.0] if name == "ShearX" else [0.0, shear], center=[0, 0])
    if name in ("TranslateXRel", "TranslateYRel"):
        shift = [int(magnitude), 0] if name == "TranslateXRel" else [0, int(magnitude)]
        return TF.affine(images, angle=0.0, translate=shift, scale=1.0, shear=[0.0, 0.0], interpolation=nearest,
                         fill=fill)
    if name == "Rotate":
        return TF.rotate(images, angle=magnitude, interpolation=nearest, fill=fill)
    if name == "Brightness":
        return TF.adjust_brightness(images, brightness_factor=1.0 + magnitude)
    if name == "Color":
        return TF.adjust_saturation(images, saturation_factor=1.0 + magnitude)
    if name == "Contrast":
        return TF.adjust_contrast(images, contrast_factor=1.0 + magnitude)
    if name == "Sharpness":
        return TF.adjust_sharpness(images, sharpness_factor=1.0 + magnitude)
    if name == "Posterize":
        return TF.posterize(images, bits=int(magnitude))
    if name == "Solarize":
        return TF.solarize(images, threshold=magnitude)
    if name == "SolarizeAdd":
        return torch.where(images < 128, (images.short() + int(magnitude)).clamp_(max=255).byte(), images)
    if name == "AutoContrast":
        return TF.autocontrast(images)
    if name == "Equalize":
        return TF.equalize(images)
    if name == "Invert":
        return TF.invert(images)
    raise ValueError(f"no RandAugment operation {name!r}")


NUM_OPS = 2
OP_PROBABILITY = 0.5  # timm's rand-m9: each of the two operations applied with probability 0.5
PARAMS = 2 * NUM_OPS + 4  # per sample: (op, magnitude) x NUM_OPS, erasing box (top, left, height, width)


class TensorAugment:
    """The training transform on uint8 CHW tensors, in its two stages (see the module docstring).

    `augment` full: crop (scale 0.08 to 1), flip, RandAugment, normalise, random erasing (p 0.2); light: crop of
    half the image or more and the flip only, as `build_transform(..., augment="light")`."""

    def __init__(self, image_size: int, mean: Sequence[float], std: Sequence[float],
                 augment: Literal["full", "light"] = "full", magnitude: float = 9.0) -> None:
        self.image_size = image_size
        self.mean = torch.tensor(list(mean), dtype=torch.float32)
        self.std = torch.tensor(list(std), dtype=torch.float32)
        scale = LIGHT_SCALE if augment == "light" else SCALE
        self.geometry = v2.Compose([
            v2.RandomResizedCrop(image_size, scale=scale, ratio=RATIO,
                                 interpolation=v2.InterpolationMode.BILINEAR, antialias=True),
            v2.RandomHorizontalFlip(0.5),
        ])
        self.full = augment == "full"
        self.fill = [round(255 * m) for m in mean]  # timm fills rotations and shears with the mean colour
        self.space = randaugment_space(magnitude, image_size, image_size)
        self.erase_probability = RE_PROB if self.full else 0.0

    def sample(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-sample stage, drawing from torch's generator: the uint8 `(3, S, S)` crop and its `PARAMS`
        draws (float64: RandAugment's operation indices and magnitudes, then the erasing box, -1s for none)."""
        crop = self.geometry(image).contiguous()
        params = [0.0] * (2 * NUM_OPS) + [-1.0] * 4
        if self.full:
            ops = torch.randint(1, len(self.space), (NUM_OPS,)).tolist()  # with replacement, as timm's
            for k, op in enumerate(ops):
                if torch.rand(()) >= OP_PROBABILITY:
                    continue  # timm's AugmentOp skips each operation with probability 0.5
                _, magnitude, signed = self.space[op]
                value = 0.0 if magnitude is None else magnitude
                if signed and torch.rand(()) < 0.5:
                    value = -value
                params[2 * k], params[2 * k + 1] = float(op), value
            if (box := erase_box(self.image_size, self.image_size, self.erase_probability)) is not None:
                params[2 * NUM_OPS:] = [float(v) for v in box]
        return crop, torch.tensor(params, dtype=torch.float64)

    def color_batch(self, images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """The batch stage: uint8 `(B, 3, S, S)` (any device) and the `(B, PARAMS)` draws -> normalised float32.
        Samples that drew the same operation and magnitude in a slot go through one call together."""
        rows = params.tolist()
        images = images.clone() if any(r[2 * k] for r in rows for k in range(NUM_OPS)) else images
        for k in range(NUM_OPS):
            groups: dict[tuple[int, float], list[int]] = {}
            for i, r in enumerate(rows):
                if int(r[2 * k]):  # 0: Identity
                    groups.setdefault((int(r[2 * k]), r[2 * k + 1]), []).append(i)
            if not groups:
                continue
            # The groups' rows, one after another: one copy to the device per slot (a copy per group would wait
            # for the device each time), each group a slice of it.
            order = torch.tensor([i for members in groups.values() for i in members])
            if images.is_cuda:
                order = order.pin_memory()
            order = order.to(images.device, non_blocking=True)
            start = 0
            for (op, magnitude), members in groups.items():
                index = order[start:start + len(members)]
                start += len(members)
                images[index] = apply_op(images[index], self.space[op][0], magnitude, self.fill)
        out = to_float(images, self.mean.to(images.device), self.std.to(images.device))
        for i, r in enumerate(rows):
            top, left, h, w = (int(v) for v in r[2 * NUM_OPS:])
            if h > 0:
                out[i, :, top:top + h, left:left + w] = 0
        return out

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """Both stages on one uint8 `(3, H, W)` image, drawing from torch's generator as it stands."""
        crop, params = self.sample(image)
        return self.color_batch(crop[None], params[None])[0]


class TensorEval:
    """The evaluation transform on a cached image (already resized to the eval transform's shorter side): centre
    crop, to float, normalise; equal to the PIL eval transform's output bit for bit."""

    def __init__(self, image_size: int, mean: Sequence[float], std: Sequence[float]) -> None:
        self.image_size = image_size
        self.mean = torch.tensor(list(mean), dtype=torch.float32)
        self.std = torch.tensor(list(std), dtype=torch.float32)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return to_float(TF.center_crop(image, [self.image_size, self.image_size]), self.mean, self.std)
