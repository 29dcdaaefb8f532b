"""The decode cache (`xbn.data.cache`) and the tensor transforms read from it (`xbn.data.tensor_transforms`),
against the PIL path (`ImageDataset` + timm's transform), which stays the reference (`data.cache: false`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from xbn.data import ImageDataset, build_transform
from xbn.data.cache import CachedImageDataset, DecodedImages, cache_path, content_key, prepare, read_index
from xbn.data.seeding import seeded_rngs
from xbn.data.tensor_transforms import TensorAugment

MEAN = STD = (0.5, 0.5, 0.5)  # a uint8 pixel never normalises to exactly 0: exact zeros are erased pixels


def noise_images(root: Path, sizes: list[tuple[int, int]], seed: int = 0) -> pd.DataFrame:
    """Real image files of random content (PNG and JPEG, several sizes and aspects), two classes."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, (w, h) in enumerate(sizes):
        # smooth random content (upsampled noise), as photos are: resizing has something to interpolate
        small = rng.integers(0, 256, (max(h // 4, 2), max(w // 4, 2), 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((w, h), Image.BILINEAR)
        path = f"c{i % 2}/img{i}.{'jpg' if i % 3 == 0 else 'png'}"
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        image.save(root / path)
        rows.append({"path": path, "label": f"c{i % 2}"})
    return pd.DataFrame(rows)


SIZES = [(40, 40), (64, 48), (30, 90), (120, 80), (20, 24), (97, 61)]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XBN_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "images"
    return root, noise_images(root, SIZES)


def cached(root: Path, frame: pd.DataFrame, size: int, mode: str = "eval", md5: str | None = None,
           augment: str = "full") -> tuple[CachedImageDataset, ImageDataset, dict]:
    images = ImageDataset(frame, root, transform=build_transform(size, mode == "eval", MEAN, STD) if mode != "eval"
                          else build_transform(size, False, MEAN, STD))
    record = prepare(images, size, True, 4.0, md5)
    return (CachedImageDataset(DecodedImages(record["path"], record["key"]), images, size, MEAN, STD, mode=mode,
                               augment=augment), images, record)


# (a) the eval-style transform --------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [32, 64])
def test_eval_transform_from_the_cache_equals_the_pil_path_exactly(folder, size):
    """The cache stores each image resized by the eval transform's own Resize (PIL, bilinear, shorter side
    floor(size / 0.875)), so the cached eval path is the centre crop of the same uint8 pixels: tolerance 0."""
    root, frame = folder
    frame = frame.assign(x0=[np.nan, 2, np.nan, 10, np.nan, 0], y0=[np.nan, 3, np.nan, 5, np.nan, 0],
                         x1=[np.nan, 50, np.nan, 100, np.nan, 90], y1=[np.nan, 40, np.nan, 70, np.nan, 61])
    data, images, _ = cached(root, frame, size)
    for i in range(len(images)):
        ours, reference = data[i][0], images[i][0]
        assert ours.shape == reference.shape == (3, size, size)
        assert torch.equal(ours, reference), (i, (ours - reference).abs().max())


# (b) the training transform: the same augmentation statistics ------------------------------------------------
def draws(dataset, n: int, collate=None, offset: int = 0) -> torch.Tensor:
    samples = []
    for j in range(n):
        with seeded_rngs(offset + j):
            samples.append(dataset[j % len(dataset)])
    return collate(samples)[0] if collate else torch.stack([s[0] for s in samples])


def test_training_augmentation_statistics_match_the_pil_path(glyph_root, tmp_path, monkeypatch):
    """Over N = 960 augmented glyph images (32 px): per-channel mean and std of the outputs, and the fraction of
    images with an erased box, against timm's PIL pipeline. Sampling noise with N = 960: the per-image mean
    spreads by ~0.33, so a difference of two channel means has a standard error of ~0.015; the erased fraction
    (p = 0.2) ~0.018. Tolerances of ~3.3 standard errors: 0.05 on the mean, 0.04 on the std (measured: 0.003
    and 0.015 apart), 0.06 on the erased fraction. torchvision's v2.RandAugment (always both operations,
    negated enhance factors) missed the mean by 0.15, and a wrong solarize threshold alone by 0.04."""
    monkeypatch.setenv("XBN_CACHE_DIR", str(tmp_path / "cache"))
    paths = sorted(str(p.relative_to(glyph_root)) for p in glyph_root.rglob("*.png"))
    frame = pd.DataFrame({"path": paths, "label": [Path(p).parent.name for p in paths]})
    data, _, _ = cached(glyph_root, frame, 32, mode="train")
    pil = ImageDataset(frame, glyph_root, transform=build_transform(32, True, MEAN, STD))
    ours, reference = draws(data, 960, data.collate), draws(pil, 960)
    assert ours.shape == reference.shape == (960, 3, 32, 32)
    mean_gap = (ours.mean(dim=(0, 2, 3)) - reference.mean(dim=(0, 2, 3))).abs().max().item()
    std_gap = (ours.std(dim=(0, 2, 3)) - reference.std(dim=(0, 2, 3))).abs().max().item()

    def erased(x):
        return ((x == 0).flatten(1).sum(1) >= 0.01 * x[0].numel()).float().mean().item()

    print(f"mean gap {mean_gap:.4f}, std gap {std_gap:.4f}, erased {erased(ours):.3f} vs {erased(reference):.3f}")
    assert mean_gap < 0.05 and std_gap < 0.04, (mean_gap, std_gap)
    assert abs(erased(ours) - erased(reference)) < 0.06 and 0.15 < erased(ours) < 0.25


def test_flip_fraction_matches_the_pil_path(tmp_path, monkeypatch):
    """Half black, half white: after crop and flip (light augmentation, no colour operations) the brighter half
    says whether the image was flipped; p = 0.5 over N = 600: standard error of a difference ~0.029, tolerance
    0.1 (the crop may also fall on one half only: those count as neither)."""
    monkeypatch.setenv("XBN_CACHE_DIR", str(tmp_path / "cache"))
    array = np.zeros((40, 40, 3), dtype=np.uint8)
    array[:, 20:] = 255
    (tmp_path / "img").mkdir()
    Image.fromarray(array).save(tmp_path / "img" / "a.png")
    frame = pd.DataFrame({"path": ["img/a.png"], "label": ["a"]})
    data, _, _ = cached(tmp_path, frame, 32, mode="train", augment="light")
    pil = ImageDataset(frame, tmp_path, transform=build_transform(32, True, MEAN, STD, augment="light"))

    def flipped(x):
        left, right = x[..., :16].mean(dim=(1, 2, 3)), x[..., 16:].mean(dim=(1, 2, 3))
        return (left > right + 0.5).float().mean().item(), (right > left + 0.5).float().mean().item()

    ours, reference = flipped(draws(data, 600, data.collate)), flipped(draws(pil, 600))
    print(f"flipped {ours} vs {reference}")
    assert abs(ours[0] - reference[0]) < 0.1 and abs(ours[1] - reference[1]) < 0.1, (ours, reference)
    assert 0.3 < ours[0] < 0.5


def test_a_sample_depends_on_its_seed_only_and_the_device_stage_equals_the_loader_stage(folder):
    """Batching (which samples share a batch), the batch stage in the loader's collate or on the device (here the
    CPU) give the same tensors for the same seeds."""
    root, frame = folder
    loader_side, _, _ = cached(root, frame, 32, mode="train")
    device_side = CachedImageDataset(loader_side.decoded, ImageDataset(frame, root), 32, MEAN, STD,
                                     mode="train_device")
    whole = draws(loader_side, 12, loader_side.collate)
    singles = torch.cat([loader_side.collate([_seeded(loader_side, j)])[0] for j in range(12)])
    assert torch.equal(whole, singles)
    batch = device_side.collate([_seeded(device_side, j) for j in range(12)])[0]
    assert batch["pixels"].dtype == torch.uint8
    assert torch.equal(device_side.augment.color_batch(batch["pixels"], batch["params"]), whole)


def _seeded(dataset, j: int):
    with seeded_rngs(j):
        return dataset[j % len(dataset)]


def test_every_randaugment_operation_acts_per_image():
    """Each operation on a batch gives what it gives each image alone (equalize and autocontrast take their
    statistics per image, not over the batch), so a sample does not depend on its batch."""
    augment = TensorAugment(24, MEAN, STD)
    images = torch.randint(0, 256, (3, 3, 24, 24), dtype=torch.uint8)
    images[1] //= 3  # other statistics
    for op, (name, magnitude, _) in enumerate(augment.space):
        params = torch.tensor([[op, magnitude or 0.0, 0, 0, -1, -1, -1, -1]] * 3, dtype=torch.float64)
        out = augment.color_batch(images, params)
        assert out.shape == (3, 3, 24, 24) and torch.isfinite(out).all(), name
        for i in range(3):
            assert torch.equal(out[i], augment.color_batch(images[i:i + 1], params[i:i + 1])[0]), name
        if name != "Identity":
            assert not torch.equal(out, augment.color_batch(images, params * torch.tensor([0.0] + [1.0] * 7))), name


# (c) keyed by content; atomic --------------------------------------------------------------------------------
def test_a_changed_image_builds_a_new_cache_and_a_renamed_folder_does_not(folder, tmp_path):
    root, frame = folder
    _, _, first = cached(root, frame, 32)
    assert first["reason"] == "built" and "mtimes" in first["keyed_on"]
    _, _, again = cached(root, frame, 32)
    assert again["reason"] == "found" and again["path"] == first["path"]

    moved = tmp_path / "renamed"
    root.rename(moved)
    data, images, renamed = cached(moved, frame, 32)
    assert renamed["reason"] == "found" and renamed["key"] == first["key"]

    Image.fromarray(np.full((48, 64, 3), 7, dtype=np.uint8)).save(moved / frame.path[1])  # other bytes
    data, images, changed = cached(moved, frame, 32)
    assert changed["reason"] == "built" and changed["key"] != first["key"]
    assert torch.equal(data[1][0], images[1][0])  # the new pixels, not the old ones
    assert len(list((Path(os.environ["XBN_CACHE_DIR"]) / "decoded").glob("decoded-*.xbnc"))) == 2
    assert content_key(images, 64, None)[0] != changed["key"]  # the image size is in the key


def test_with_a_dvc_md5_the_key_is_the_md5_not_the_mtimes(folder):
    root, frame = folder
    images = ImageDataset(frame, root)
    key, keyed_on = content_key(images, 32, "a" * 32)
    assert keyed_on == "dvc md5" and content_key(images, 32, "b" * 32)[0] != key
    for path in frame.path:  # touched (a `dvc checkout` elsewhere): same bytes, same md5, same key
        os.utime(root / path, ns=(1, 1))
    assert content_key(images, 32, "a" * 32)[0] == key
    assert content_key(images, 32, None)[0] != key


BUILD = """
import sys
import pandas as pd
from xbn.data import ImageDataset
from xbn.data.cache import prepare
frame = pd.read_csv(sys.argv[2])
print(prepare(ImageDataset(frame, sys.argv[1]), 32, True, 4.0, None, threads=2)["path"])
"""


def test_a_build_killed_midway_leaves_no_cache_and_the_next_run_builds_it(folder, tmp_path):
    root, frame = folder
    frame = pd.concat([frame] * 30, ignore_index=True)  # 180 rows: several chunks, the fault point half-way
    frame.to_csv(tmp_path / "rows.csv", index=False)
    env = {**os.environ, "XBN_FAULT": "cache.after_rows",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, "-c", BUILD, str(root), str(tmp_path / "rows.csv")], env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert killed.returncode == -9, killed.stderr
    folder_ = Path(os.environ["XBN_CACHE_DIR"]) / "decoded"
    assert not list(folder_.glob("decoded-*.xbnc"))
    assert [p.name for p in folder_.iterdir() if p.name.endswith(".tmp")]  # the half-written temp file
    images = ImageDataset(frame, root, transform=build_transform(32, False, MEAN, STD))
    record = prepare(images, 32, True, 4.0, None)
    assert record["reason"] == "built" and read_index(record["path"])["rows"] == 180
    assert sorted(p.name for p in folder_.iterdir()) == [Path(record["path"]).name]  # the temp file removed
    data = CachedImageDataset(DecodedImages(record["path"]), images, 32, MEAN, STD, mode="eval")
    assert torch.equal(data[179][0], images[179][0])


def test_a_failed_build_raises_and_leaves_nothing(folder, monkeypatch):
    root, frame = folder
    monkeypatch.setenv("XBN_FAULT", "cache.after_rows:raise")
    with pytest.raises(RuntimeError, match="cache.after_rows"):
        cached(root, frame, 32)
    assert not list((Path(os.environ["XBN_CACHE_DIR"]) / "decoded").iterdir())


def test_auto_reads_with_pil_over_the_budget_and_unreadable_rows_are_skipped(folder, caplog):
    root, frame = folder
    images = ImageDataset(frame, root)
    assert prepare(images, 32, "auto", 1e-6, None)["path"] is None  # 1 kB budget
    assert prepare(images, 32, False, 4.0, None)["path"] is None
    (root / frame.path[2]).write_bytes(b"not an image")
    record = prepare(images, 32, "auto", 4.0, None)
    assert record["reason"] == "built" and read_index(record["path"])["offsets"][2] is None
    data = CachedImageDataset(DecodedImages(record["path"]), images, 32, MEAN, STD, skip_unreadable=True)
    assert data[2] is None and data[3] is not None
    images, _, indices = data.collate([data[i] for i in range(len(data))])
    assert images.shape == (5, 3, 32, 32) and 2 not in indices.tolist()


def test_workers_receive_the_path_not_the_pixels(folder):
    import pickle

    root, frame = folder
    data, _, _ = cached(root, frame, 32)
    data[0]  # opens the map in this process
    assert data.decoded._map is not None
    clone = pickle.loads(pickle.dumps(data))
    assert clone.decoded._map is None and len(pickle.dumps(data)) < 20_000
    assert torch.equal(clone[3][0], data[3][0])


def test_index_is_json_with_offsets_and_shapes(folder):
    root, frame = folder
    _, _, record = cached(root, frame, 32)
    index = read_index(record["path"])
    side = math.floor(32 / 0.875)
    assert index["shorter_side"] == side and all(min(s) == side for s in index["shapes"])
    assert json.dumps(index)  # plain JSON
    assert cache_path(record["key"]).name == Path(record["path"]).name
