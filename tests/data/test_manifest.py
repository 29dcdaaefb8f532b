"""The manifest: path safety, CSV round trip, checks naming the line, class-disjoint validation carving."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from xbn.data import (
    SPLITS,
    DatasetError,
    carve_validation,
    encode_labels,
    read_manifest,
    safe_relative_path,
    write_manifest,
)
from xbn.data.manifest import build_manifest, pick_classes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a/b.jpg", "a/b.jpg"),
        ("./a//b.jpg ", "a/b.jpg"),
        ("a\\b.jpg", "a/b.jpg"),
        ("x..y/z.png", "x..y/z.png"),
    ],
)
def test_safe_relative_path_normalizes(text, expected):
    assert safe_relative_path(text, "labels.txt", 3) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("../secret.jpg", "'..'"),
        ("a/../../b.jpg", "'..'"),
        ("a\\..\\b.jpg", "'..'"),
        ("/etc/passwd", "absolute"),
        ("C:\\img\\a.jpg", "absolute"),
        ("c:a.jpg", "absolute"),
        ("\\\\server\\share\\a.jpg", "absolute"),
        ("", "empty"),
        ("./", "names no file"),
    ],
)
def test_safe_relative_path_rejects_escapes_naming_file_and_line(text, reason):
    with pytest.raises(DatasetError, match=rf"list\.txt line 17: .*{reason}"):
        safe_relative_path(text, "list.txt", 17)


def _frame() -> pd.DataFrame:
    return build_manifest(
        ["a/1.jpg", "a/2.jpg", "b/1.jpg"],
        ["007", "007", "NA"],
        ["train", "train", "query"],
        [(1, 2, 30, 40), (0, 0, 5, 5), None],
    )


def test_write_then_read_round_trips_labels_and_boxes(tmp_path):
    out = tmp_path / "sub" / "manifest.csv"
    write_manifest(_frame(), out)
    assert out.read_text().splitlines() == [
        "path,label,split,x1,y1,x2,y2",
        "a/1.jpg,007,train,1,2,30,40",
        "a/2.jpg,007,train,0,0,5,5",
        "b/1.jpg,NA,query,,,,",
    ]
    back = read_manifest(out)
    pd.testing.assert_frame_equal(back, _frame())
    assert back["label"].tolist() == ["007", "007", "NA"]  # strings, not 7 or NaN
    assert back["x1"].isna().tolist() == [False, False, True]
    assert not list(tmp_path.glob("sub/.*.tmp"))  # the atomic writer left no temp file


def test_read_manifest_without_boxes_ignores_extra_columns(tmp_path):
    src = tmp_path / "m.csv"
    src.write_text("split,path,label,note\ntest,x/1.png,3,hello\n\ntrain,x/2.png,4,\n")
    df = read_manifest(src)
    assert list(df.columns) == ["path", "label", "split"]
    assert df.to_dict("list") == {
        "path": ["x/1.png", "x/2.png"],
        "label": ["3", "4"],
        "split": ["test", "train"],
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("path,label\na.png,1\n", r"line 1: header .* lacks column\(s\) \['split'\]"),
        ("path,label,split\na.png,1,train\nb.png,2,training\n", r"line 3: 'split' is 'training'"),
        ("path,label,split\na.png,1,train,extra\n", r"line 2: expected 3 fields"),
        ("path,label,split\na.png,,train\n", r"line 2: empty 'label'"),
        ("path,label,split\n../a.png,1,train\n", r"line 2: image path '../a.png' contains '..'"),
        (
            "path,label,split,x1,y1,x2,y2\na.png,1,train,1,2,x,4\n",
            r"line 2: box x1,y1,x2,y2 must be four integers",
        ),
        ("path,label,split,x1,y1,x2,y2\na.png,1,train,5,2,5,4\n", r"line 2: box \[5, 2, 5, 4\] is empty"),
        ("path,label,split,x1,y1\na.png,1,train,1,2\n", r"line 1: box columns must be all of"),
        ("path,label,split\n", r"no rows after the header"),
    ],
)
def test_read_manifest_errors_name_file_and_line(tmp_path, content, message):
    src = tmp_path / "bad.csv"
    src.write_text(content)
    with pytest.raises(DatasetError, match=rf"bad\.csv.*{message}"):
        read_manifest(src)


def test_read_manifest_missing_file(tmp_path):
    with pytest.raises(DatasetError, match=r"cannot read label file .*nope\.csv"):
        read_manifest(tmp_path / "nope.csv")


def test_write_manifest_refuses_bad_split_naming_row(tmp_path):
    df = build_manifest(["a.png", "b.png"], ["1", "2"], ["train", "dev"])
    with pytest.raises(DatasetError, match=r"row 1: 'split' is 'dev'"):
        write_manifest(df, tmp_path / "m.csv")
    assert not (tmp_path / "m.csv").exists()


def _many_classes() -> pd.DataFrame:
    train = [(f"tr/{c}/{i}.png", f"c{c:02d}", "train") for c in range(20) for i in range(3)]
    other = [
        (f"te/{c}/{i}.png", f"t{c}", s) for c in range(4) for i, s in enumerate(["test", "query", "gallery"])
    ]
    return build_manifest(*zip(*(train + other), strict=True))


def test_carve_validation_is_class_disjoint_deterministic_and_leaves_test_alone():
    df = _many_classes()
    out = carve_validation(df, 0.25, seed=3)
    val = set(out.loc[out.split == "val", "label"])
    train = set(out.loc[out.split == "train", "label"])
    assert len(val) == 5 and not val & train and val | train == set(df.loc[df.split == "train", "label"])
    assert (out.loc[out.split == "val"].groupby("label").size() == 3).all()  # whole classes moved
    pd.testing.assert_frame_equal(out[df.split != "train"], df[df.split != "train"])
    pd.testing.assert_frame_equal(out, carve_validation(df, 0.25, seed=3))
    assert (df["split"] != "val").all()  # the input is not modified
    picks = {
        tuple(sorted(set(carve_validation(df, 0.25, s).query("split == 'val'")["label"]))) for s in range(5)
    }
    assert len(picks) > 1  # the seed matters


def test_carve_validation_ignores_row_order():
    df = _many_classes()
    shuffled = df.sample(frac=1.0, random_state=0)
    a = carve_validation(df, 0.3, seed=1).sort_values("path").reset_index(drop=True)
    b = carve_validation(shuffled, 0.3, seed=1).sort_values("path").reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)


def test_pick_classes_bounds():
    assert pick_classes(["a", "b"], 0.01, 0) != []  # at least one class when fraction > 0
    assert len(pick_classes(list("abc"), 0.99, 0)) == 2  # never all of them
    assert pick_classes(["a"], 0.5, 0) == [] and pick_classes(list("abcd"), 0.0, 0) == []
    with pytest.raises(ValueError, match="fraction"):
        pick_classes(list("abc"), 1.0, 0)


def test_encode_labels_sorted_unique_codes():
    codes = encode_labels(["b", "a", "10", "b", "2"])
    assert codes.dtype == np.int64
    assert codes.tolist() == [3, 2, 0, 3, 1]  # sorted: "10" < "2" < "a" < "b"
    assert encode_labels(pd.Series(["x", "y", "x"])).tolist() == [0, 1, 0]


def test_splits_constant():
    assert SPLITS == ("train", "val", "test", "query", "gallery")
