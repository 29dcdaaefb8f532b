"""ImageDataset: RGB tensors, labels and indices, box crops, and errors that name the image's full path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xbn.data import DatasetError, ImageDataset, read_dataset
from xbn.data.manifest import build_manifest

from .fixtures import write_csv, write_deepfashion2, write_image


def test_items_are_rgb_tensors_with_label_and_index(tmp_path):
    write_csv(tmp_path)  # grayscale PNGs
    df = read_dataset("csv", tmp_path)
    ds = ImageDataset(df, tmp_path)
    assert len(ds) == 8
    image, label, index = ds[5]
    assert image.shape == (3, 16, 24) and image.dtype == torch.float32
    assert torch.equal(image[0], image[2])  # gray replicated to 3 channels
    assert ds.labels.tolist() == [0, 0, 1, 1, 3, 3, 2, 2]  # sorted: "007" < "010" < "NA" < "a b"
    assert (label, index) == (3, 5)


def test_explicit_labels_and_transform(tmp_path):
    write_csv(tmp_path)
    df = read_dataset("csv", tmp_path).iloc[:3]
    ds = ImageDataset(df, tmp_path, labels=[7, 8, 9], transform=lambda im: torch.tensor(im.size))
    image, label, index = ds[2]
    assert (image.tolist(), label, index) == ([24, 16], 9, 2)
    with pytest.raises(ValueError, match="3 manifest rows but labels of shape"):
        ImageDataset(df, tmp_path, labels=np.zeros(2))


def test_boxes_crop_the_image(tmp_path):
    write_deepfashion2(tmp_path)
    df = read_dataset("deepfashion2", tmp_path)
    ds = ImageDataset(df, tmp_path)
    sizes = [tuple(ds[i][0].shape[1:]) for i in range(len(ds))]
    expected = [(int(r.y2 - r.y1), int(r.x2 - r.x1)) for r in df.itertuples()]
    assert sizes == expected == [(15, 18), (20, 30), (8, 12), (8, 8), (18, 24), (10, 10)]


def test_whole_image_when_box_is_empty(tmp_path):
    write_image(tmp_path / "a.png", size=(10, 6))
    df = build_manifest(["a.png", "a.png"], ["x", "x"], ["test", "test"], [None, (2, 1, 6, 5)])
    ds = ImageDataset(df, tmp_path)
    assert ds[0][0].shape == (3, 6, 10) and ds[1][0].shape == (3, 4, 4)


def test_missing_and_corrupt_images_name_the_full_path(tmp_path):
    write_image(tmp_path / "ok.png")
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8 definitely not a jpeg")
    df = build_manifest(["ok.png", "gone.png", "bad.jpg"], ["a", "a", "a"], ["train"] * 3)
    ds = ImageDataset(df, tmp_path)
    ds[0]
    with pytest.raises(DatasetError, match=rf"cannot read image {tmp_path.resolve()}/gone\.png"):
        ds[1]
    with pytest.raises(DatasetError, match=rf"cannot read image {tmp_path.resolve()}/bad\.jpg"):
        ds[2]


def test_dataloader_with_the_batch_sampler(tmp_path):
    from torch.utils.data import DataLoader

    from xbn.data import ClassBalancedBatchSampler, build_transform

    write_csv(tmp_path)
    df = read_dataset("csv", tmp_path)
    ds = ImageDataset(df, tmp_path, transform=build_transform(16, True, (0.5,) * 3, (0.5,) * 3))
    sampler = ClassBalancedBatchSampler(ds.labels, batch_size=4, samples_per_class=2, seed=0)
    batches = list(DataLoader(ds, batch_sampler=sampler))
    assert len(batches) == 2
    for images, labels, index in batches:
        assert images.shape == (4, 3, 16, 16)
        assert torch.equal(labels, torch.as_tensor(ds.labels)[index])
        assert sorted(torch.bincount(labels).tolist(), reverse=True)[:2] == [2, 2]
