"""The expectation suite on tiny datasets: a valid one passes; each breakage fails the right expectation
and lists exactly the rows that cause it."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from xbn.config import ValidateConfig
from xbn.validation import PUBLISHED_COUNTS, ValidationResult, validate_manifest

from .builders import build_dataset, jpeg_bytes, row_of, write_image


@pytest.fixture
def data(tmp_path):
    root = tmp_path / "root"
    return root, build_dataset(root)


def run(frame, root, dataset: str = "glyphs", **cfg) -> ValidationResult:
    return validate_manifest(frame, root, ValidateConfig(**cfg), dataset)


def failing_rows(result: ValidationResult, name: str) -> list[int]:
    """Rows named by expectation `name`, which must be the only one failing."""
    assert [o.name for o in result.failed] == [name], result.to_markdown()
    outcome = result.outcome(name)
    assert outcome.unexpected_count == len(outcome.examples)
    return sorted(e["row"] for e in outcome.examples)


def test_valid_dataset_passes_every_expectation(data):
    root, frame = data
    result = run(frame, root)
    assert result.success, result.to_markdown()
    names = {o.name for o in result.outcomes}
    assert {"path_inside_root", "file_exists", "image_decodes", "image_width_in_bounds",
            "class_min_images", "classes_disjoint_train_eval", "no_image_in_two_splits",
            "label_not_null"} <= names
    assert not any(n.startswith("published_") for n in names)  # glyphs have no published counts
    assert result.summary["splits"]["train"] == {"images": 4, "classes": 2}


def test_missing_file(data):
    root, frame = data
    (root / frame.at[3, "path"]).unlink()
    result = run(frame, root)
    assert failing_rows(result, "file_exists") == [3]
    example = result.outcome("file_exists").examples[0]
    assert example["path"] == "images/bee/1.jpg" and example["label"] == "bee" and example["split"] == "train"
    assert example["detail"] == str((root / "images/bee/1.jpg").resolve())


def test_corrupt_and_truncated_jpegs(data):
    root, frame = data
    (root / frame.at[1, "path"]).write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    whole = jpeg_bytes(seed=99)
    (root / frame.at[7, "path"]).write_bytes(whole[: len(whole) // 2])  # header intact, scan data cut
    result = run(frame, root)
    assert failing_rows(result, "image_decodes") == [1, 7]
    details = {e["row"]: e["detail"] for e in result.outcome("image_decodes").examples}
    assert "truncated" in details[7]


def test_path_escaping_the_root(data, tmp_path):
    root, frame = data
    outside = write_image(tmp_path / "outside.png", seed=50)
    (root / "images" / "ant" / "link.png").symlink_to(outside)
    extra = pd.DataFrame([("../outside.png", "ant", "train"), ("images/ant/link.png", "ant", "train"),
                          (str(outside), "ant", "train")], columns=frame.columns)
    frame = pd.concat([frame, extra], ignore_index=True)
    result = run(frame, root)
    assert failing_rows(result, "path_inside_root") == [10, 11, 12]
    assert result.outcome("file_exists").success  # escaping files are not looked at


def test_train_test_class_overlap(data):
    root, frame = data
    frame.loc[row_of(frame, "images/dog/0.png"), "label"] = "ant"  # an ant image filed under test
    result = run(frame, root, min_images_per_class=1)  # (dog and the test ant keep one image each)
    rows = failing_rows(result, "classes_disjoint_train_eval")
    assert rows == [0, 1, 6]  # both train ant images and the test one
    assert {e["detail"] for e in result.outcome("classes_disjoint_train_eval").examples} == {"test, train"}


def test_train_val_class_overlap(data):
    root, frame = data
    frame.loc[4, "split"] = "train"  # one cat image in train, the other in val
    assert failing_rows(run(frame, root, min_images_per_class=1), "classes_disjoint_train_val") == [4, 5]


def test_duplicate_image_across_splits(data):
    root, frame = data
    shutil.copy(root / frame.at[0, "path"], root / frame.at[6, "path"])  # a train image reappears in test
    shutil.copy(root / frame.at[8, "path"], root / frame.at[9, "path"].replace(".jpg", ".png"))
    frame.loc[9, "path"] = frame.at[9, "path"].replace(".jpg", ".png")  # a copy within test: allowed
    result = run(frame, root)
    assert failing_rows(result, "no_image_in_two_splits") == [0, 6]
    details = {e["row"]: e["detail"] for e in result.outcome("no_image_in_two_splits").examples}
    assert details == {0: "row 6 (test): images/dog/0.png", 6: "row 0 (train): images/ant/0.png"}


def test_same_photo_with_different_boxes_is_not_a_duplicate(data):
    root, frame = data
    shutil.copy(root / frame.at[0, "path"], root / frame.at[6, "path"])
    for col, value in zip(("x1", "y1", "x2", "y2"), (0, 0, 8, 6)):
        frame[col] = pd.array([value] + [None] * (len(frame) - 1), dtype="Int64")
    assert run(frame, root).success


def test_a_class_with_one_image_fails_in_every_split(data):
    root, frame = data
    frame = frame.drop(index=[2, 9]).reset_index(drop=True)  # bee (train) and eel (test) keep one image each
    result = run(frame, root)
    assert failing_rows(result, "class_min_images") == [2, 7]  # a lone test class is a query with no answer
    assert [e["detail"] for e in result.outcome("class_min_images").examples] == [1, 1]
    assert {e["split"] for e in result.outcome("class_min_images").examples} == {"train", "test"}
    assert run(frame, root, min_images_per_class=1).success


def test_null_and_blank_labels(data):
    root, frame = data
    frame.loc[5, "label"] = None  # (leaves the other val cat alone: min_images_per_class=1 lets it be)
    assert failing_rows(run(frame, root, min_images_per_class=1), "label_not_null") == [5]
    frame.loc[5, "label"] = "  "
    assert failing_rows(run(frame, root, min_images_per_class=1), "label_not_blank") == [5]


def test_image_size_bounds(data):
    root, frame = data
    write_image(root / frame.at[2, "path"], seed=2, size=(4, 30))
    result = run(frame, root, max_image_side=20)
    assert sorted(o.name for o in result.failed) == ["image_height_in_bounds", "image_width_in_bounds"]
    assert [(e["row"], e["detail"]) for e in result.outcome("image_width_in_bounds").examples] == [(2, 4)]


def test_published_counts_for_known_datasets(data, monkeypatch):
    root, frame = data
    result = run(frame, root, dataset="cub")
    assert sorted(o.name for o in result.failed) == ["published_classes_test", "published_classes_train",
                                                     "published_images_test", "published_images_train"]
    images = result.outcome("published_images_train")
    assert (images.observed, images.expected) == (6, 5_864)  # train + val
    assert run(frame, root, dataset="cub", check_published_counts=False).success
    monkeypatch.setitem(PUBLISHED_COUNTS, "cub", {"train": (6, 3), "test": (4, 2)})
    assert run(frame, root, dataset="cub").success


def test_wrong_columns_and_types(data):
    root, frame = data
    result = run(frame.rename(columns={"label": "class"}), root)
    assert [o.name for o in result.failed] == ["label_column_exists"]
    assert "class_min_images" not in {o.name for o in result.outcomes}  # needs labels
    typed = frame.astype({"label": object})
    typed.loc[3, "label"] = 7
    assert failing_rows(run(typed, root, min_images_per_class=1), "label_is_text") == [3]


def test_unknown_split_and_empty_test_side(data):
    root, frame = data
    frame.loc[6:, "split"] = "holdout"
    result = run(frame, root)
    assert sorted(o.name for o in result.failed) == ["eval_splits_not_empty", "split_known"]
    assert result.outcome("split_known").unexpected_count == 4


def test_examples_are_capped_and_reports_render(data):
    root, frame = data
    missing = [frame.assign(path=frame["path"] + f".{i}") for i in range(2)]
    frame = pd.concat([frame, *missing], ignore_index=True)
    result = run(frame, root)
    outcome = result.outcome("file_exists")
    assert outcome.unexpected_count == 20 and len(outcome.examples) == 10
    report = json.loads(result.to_json())
    assert report["success"] is False and report["summary"]["failed"] == ["file_exists"]
    text = result.to_markdown()
    assert "## FAILED `file_exists`" in text and "first 10 of 20" in text
    assert "| 10 | images/ant/0.png.0 | ant | train |" in text


def test_missing_root_fails_every_file(data, tmp_path):
    _, frame = data
    result = run(frame, tmp_path / "nowhere")
    assert failing_rows(result, "file_exists") == list(range(10))


def test_empty_manifest_fails_on_empty_splits(data):
    root, frame = data
    result = run(frame.iloc[:0], root)
    assert sorted(o.name for o in result.failed) == ["eval_splits_not_empty", "train_split_not_empty"]
