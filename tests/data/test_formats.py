"""Each reader on a tiny tree in its exact on-disk layout: counts, labels, splits, boxes and clear errors."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from xbn.data import READERS, DatasetError, read_dataset

from .fixtures import (
    write_cars,
    write_csv,
    write_cub,
    write_deepfashion2,
    write_folder,
    write_inshop,
    write_sop,
)


def _by_split(df: pd.DataFrame) -> dict[str, list[str]]:
    return {s: sorted(set(g["label"])) for s, g in df.groupby("split")}


def _images_exist(df: pd.DataFrame, root) -> bool:
    return all((root / p).is_file() for p in df["path"])


def test_registry_names():
    assert set(READERS) == {"cub", "cars196", "sop", "inshop", "deepfashion2", "folder", "csv", "glyphs"}
    assert READERS["glyphs"] is READERS["csv"]


def test_cub_split_by_class_id(tmp_path):
    write_cub(tmp_path, classes=(1, 100, 101, 200), per_class=3)
    df = read_dataset("cub", tmp_path)
    assert len(df) == 12 and _images_exist(df, tmp_path)
    assert _by_split(df) == {"test": ["101", "200"], "train": ["1", "100"]}
    assert df["path"].iloc[0] == "images/001.Bird_1/Bird_1_0000_1.jpg"
    assert "x1" not in df.columns


def test_cub_malformed_label_files(tmp_path):
    write_cub(tmp_path)
    labels = tmp_path / "image_class_labels.txt"
    good = labels.read_text()
    labels.write_text(good.replace("3 2\n", "3 two\n"))
    with pytest.raises(
        DatasetError, match=r"image_class_labels\.txt line 3: class_id 'two' is not an integer"
    ):
        read_dataset("cub", tmp_path)
    labels.write_text(good.replace("3 2\n", "3 2 9\n"))
    with pytest.raises(DatasetError, match=r"image_class_labels\.txt line 3: expected 2 fields"):
        read_dataset("cub", tmp_path)
    labels.write_text(good.replace("3 2\n", ""))
    with pytest.raises(DatasetError, match=r"no class_id for image_id 3"):
        read_dataset("cub", tmp_path)
    labels.unlink()
    with pytest.raises(DatasetError, match=r"cannot read label file .*image_class_labels\.txt"):
        read_dataset("cub", tmp_path)


def test_cub_path_escape_names_line(tmp_path):
    write_cub(tmp_path)
    images = tmp_path / "images.txt"
    lines = images.read_text().splitlines()
    lines[4] = "5 ../../etc/passwd"
    images.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        DatasetError, match=r"images\.txt line 5: image path '../../etc/passwd' contains '..'"
    ):
        read_dataset("cub", tmp_path)


def test_cars196_reads_struct_annotations(tmp_path):
    write_cars(tmp_path, classes=(1, 98, 99, 196), per_class=2)
    df = read_dataset("cars196", tmp_path)
    assert len(df) == 8 and _images_exist(df, tmp_path)
    assert df["path"].tolist()[:2] == ["car_ims/000001.jpg", "car_ims/000002.jpg"]
    assert _by_split(df) == {"test": ["196", "99"], "train": ["1", "98"]}


def test_cars196_rejects_absolute_path_and_bad_file(tmp_path):
    write_cars(tmp_path, classes=(1, 99), per_class=1, paths=["car_ims/000001.jpg", "/tmp/x.jpg"])
    with pytest.raises(
        DatasetError, match=r"cars_annos\.mat annotation #2: image path '/tmp/x.jpg' is absolute"
    ):
        read_dataset("cars196", tmp_path)
    (tmp_path / "cars_annos.mat").write_bytes(b"not a mat file at all")
    with pytest.raises(DatasetError, match=r"cannot read .*cars_annos\.mat"):
        read_dataset("cars196", tmp_path)


def test_sop_train_and_test_files(tmp_path):
    write_sop(tmp_path, train_classes=(1, 2, 3), test_classes=(4, 5), per_class=3)
    df = read_dataset("sop", tmp_path)
    assert len(df) == 15 and _images_exist(df, tmp_path)
    assert _by_split(df) == {"test": ["4", "5"], "train": ["1", "2", "3"]}


def test_sop_errors(tmp_path):
    write_sop(tmp_path)
    test_txt = tmp_path / "Ebay_test.txt"
    good = test_txt.read_text()
    test_txt.write_text(good.replace("image_id class_id", "id class"))
    with pytest.raises(
        DatasetError, match=r"Ebay_test\.txt line 1: header is 'id class super_class_id path'"
    ):
        read_dataset("sop", tmp_path)
    lines = good.splitlines()
    lines[2] = lines[2].replace(" 4 ", " four ")
    test_txt.write_text("\n".join(lines))
    with pytest.raises(DatasetError, match=r"Ebay_test\.txt line 3: class_id 'four' is not an integer"):
        read_dataset("sop", tmp_path)


def test_inshop_partition_with_padded_whitespace(tmp_path):
    write_inshop(tmp_path, train_items=(2, 3), test_items=(7, 8, 9))
    df = read_dataset("inshop", tmp_path)
    assert df["split"].value_counts().to_dict() == {"gallery": 6, "train": 4, "query": 3}
    assert _images_exist(df, tmp_path)
    assert _by_split(df)["query"] == _by_split(df)["gallery"] == ["id_00000007", "id_00000008", "id_00000009"]
    assert df["path"].iloc[0] == "img/WOMEN/Dresses/id_00000002/01_1_front.jpg"


def test_inshop_errors(tmp_path):
    write_inshop(tmp_path)
    src = tmp_path / "Eval" / "list_eval_partition.txt"
    lines = src.read_text().splitlines()
    src.write_text("\n".join(["99"] + lines[1:]))
    with pytest.raises(
        DatasetError, match=r"list_eval_partition\.txt line 1: says 99 images but the file lists 13"
    ):
        read_dataset("inshop", tmp_path)
    src.write_text("\n".join(lines[:5] + [lines[5].replace("train", "probe")] + lines[6:]))
    with pytest.raises(DatasetError, match=r"line 6: evaluation_status 'probe'"):
        read_dataset("inshop", tmp_path)
    src.write_text("\n".join(lines[:3] + ["img/a.jpg id_1"] + lines[4:]))
    with pytest.raises(DatasetError, match=r"line 4: expected 3 fields"):
        read_dataset("inshop", tmp_path)


def test_deepfashion2_items_boxes_and_splits(tmp_path):
    write_deepfashion2(tmp_path)
    df = read_dataset("deepfashion2", tmp_path)
    rows = [tuple(r) for r in df[["path", "label", "split", "x1", "y1", "x2", "y2"]].itertuples(index=False)]
    assert (
        rows
        == [  # style-0 items skipped; train keeps both sources; validation user -> query, shop -> gallery
            ("train/image/000001.jpg", "train/1_1_1", "train", 2, 3, 20, 18),
            ("train/image/000002.jpg", "train/1_1_1", "train", 0, 0, 30, 20),
            ("validation/image/000001.jpg", "validation/5_7_2", "query", 4, 4, 16, 12),
            ("validation/image/000001.jpg", "validation/5_1_1", "query", 1, 1, 9, 9),
            ("validation/image/000002.jpg", "validation/5_7_2", "gallery", 0, 2, 24, 20),
            ("validation/image/000003.jpg", "validation/5_1_1", "gallery", 3, 3, 13, 13),
        ]
    )
    assert str(df["x1"].dtype) == "Int64" and _images_exist(df, tmp_path)


def test_deepfashion2_errors(tmp_path):
    write_deepfashion2(tmp_path)
    anno = tmp_path / "validation" / "annos" / "000002.json"
    data = json.loads(anno.read_text())
    data["item1"]["bounding_box"] = [5, 5, 2]
    anno.write_text(json.dumps(data))
    with pytest.raises(DatasetError, match=r"000002\.json: item1: 'bounding_box' must be \[x1, y1, x2, y2\]"):
        read_dataset("deepfashion2", tmp_path)
    del data["item1"]["style"]
    anno.write_text(json.dumps(data))
    with pytest.raises(DatasetError, match=r"000002\.json: item1: 'style' must be an integer, got None"):
        read_dataset("deepfashion2", tmp_path)
    anno.write_text("{broken")
    with pytest.raises(DatasetError, match=r"cannot read annotation .*000002\.json"):
        read_dataset("deepfashion2", tmp_path)
    with pytest.raises(DatasetError, match=r"neither train/annos nor validation/annos"):
        read_dataset("deepfashion2", tmp_path / "validation")


def test_folder_class_disjoint_seeded_split(tmp_path):
    classes = [f"class_{i}" for i in range(6)]
    write_folder(tmp_path, classes=classes, per_class=3)
    df = read_dataset("folder", tmp_path)
    assert len(df) == 18 and _images_exist(df, tmp_path)  # notes.txt ignored, .JPG/.jpeg counted
    split = _by_split(df)
    assert len(split["test"]) == 3 and not set(split["test"]) & set(split["train"])
    again = read_dataset("folder", tmp_path, seed=0)
    pd.testing.assert_frame_equal(df, again)
    tests = {tuple(_by_split(read_dataset("folder", tmp_path, seed=s))["test"]) for s in range(6)}
    assert len(tests) > 1
    assert len(_by_split(read_dataset("folder", tmp_path, test_fraction=0.2))["test"]) == 1


def test_folder_needs_two_classes(tmp_path):
    write_folder(tmp_path, classes=("only",))
    with pytest.raises(DatasetError, match="at least 2 class folders"):
        read_dataset("folder", tmp_path)


def test_csv_and_glyphs_read_labels_csv(tmp_path):
    write_csv(tmp_path)
    df = read_dataset("glyphs", tmp_path)
    assert len(df) == 8 and _images_exist(df, tmp_path)
    assert _by_split(df) == {"test": ["NA", "a b"], "train": ["007", "010"]}
    other = tmp_path / "elsewhere.csv"
    other.write_text("path,label,split\nimages/007/0.png,007,query\n")
    assert read_dataset("csv", tmp_path, labels_file=other)["split"].tolist() == ["query"]


def test_csv_errors_name_file_and_line(tmp_path):
    write_csv(tmp_path, rows=[("a/1.png", "x", "train"), ("a/2.png", "x", "train")])
    src = tmp_path / "labels.csv"
    src.write_text(src.read_text() + "/abs/3.png,x,train\n")
    with pytest.raises(DatasetError, match=r"labels\.csv line 4: image path '/abs/3.png' is absolute"):
        read_dataset("csv", tmp_path)
    with pytest.raises(DatasetError, match=r"cannot read label file .*missing\.csv"):
        read_dataset("csv", tmp_path, labels_file=tmp_path / "missing.csv")


def test_read_dataset_argument_errors(tmp_path):
    with pytest.raises(DatasetError, match=r"unknown dataset format 'imagenet'; known: \['cars196'"):
        read_dataset("imagenet", tmp_path)
    with pytest.raises(DatasetError, match=r"dataset root .*nowhere is not a directory"):
        read_dataset("cub", tmp_path / "nowhere")
    with pytest.raises(DatasetError, match=r"labels_file is only read by csv-layout datasets, not 'cub'"):
        read_dataset("cub", tmp_path, labels_file="x.csv")
