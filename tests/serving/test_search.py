"""Searching the catalogue with image files: neighbours per image, errors per image, table and JSON output."""

from __future__ import annotations

import json

import pytest

from xbn.serving.index import IndexConfig, build_catalogue
from xbn.serving.search import format_json, format_table, search_images
from xbn.serving.sources import read_source


@pytest.fixture(scope="module")
def catalogue(served, image_root):
    frame, root = read_source(image_root / "manifest.csv")
    return build_catalogue(served, frame, root, IndexConfig())


def test_a_catalogue_image_finds_itself_first(served, catalogue, image_root):
    results = search_images(
        served, catalogue, [image_root / "class2/img1.png", image_root / "class4/img3.png"], k=3
    )
    assert [r["query"] for r in results] == [
        str(image_root / "class2/img1.png"),
        str(image_root / "class4/img3.png"),
    ]
    first = results[0]["results"]
    assert [r["rank"] for r in first] == [1, 2, 3]
    assert first[0]["path"] == "class2/img1.png" and first[0]["label"] == "class2"
    assert first[0]["score"] == pytest.approx(1.0, abs=1e-4)
    assert first[0]["score"] >= first[1]["score"] >= first[2]["score"]
    assert results[1]["results"][0]["path"] == "class4/img3.png"


def test_an_unreadable_image_is_named_and_the_others_still_answer(
    served, catalogue, image_root, broken_image, tmp_path
):
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    queries = [broken_image, image_root / "class0/img0.png", tmp_path / "missing.png", text]
    results = search_images(served, catalogue, queries, k=2)
    assert [("error" in r) for r in results] == [True, False, True, True]
    assert str(broken_image) in results[0]["error"] and "truncated" in results[0]["error"]
    assert "missing.png: no such file" in results[2]["error"]
    assert "notes.png" in results[3]["error"] and "not an image format" in results[3]["error"]
    assert results[1]["results"][0]["path"] == "class0/img0.png"


def test_k_above_the_catalogue_size_returns_the_whole_catalogue(served, catalogue, image_root):
    [result] = search_images(served, catalogue, [image_root / "class1/img1.png"], k=1000)
    assert len(result["results"]) == catalogue.count


def test_batches_do_not_change_the_answers(served, catalogue, image_root):
    queries = sorted(image_root.rglob("*.png"))
    small, large = (search_images(served, catalogue, queries, k=4, batch_size=b) for b in (3, 64))
    for a, b in zip(small, large):  # conv kernels may round differently per batch size: scores to 1e-4
        assert a["query"] == b["query"] and a["results"][0]["path"] == b["results"][0]["path"]
        assert [r["score"] for r in a["results"]] == pytest.approx(
            [r["score"] for r in b["results"]], abs=1e-4
        )


def test_table_and_json(served, catalogue, image_root, broken_image):
    results = search_images(served, catalogue, [image_root / "class3/img2.png", broken_image], k=2)
    assert json.loads(format_json(results)) == results
    table = format_table(results)
    lines = table.splitlines()
    assert lines[0] == f"query: {image_root / 'class3/img2.png'}"
    assert lines[1].split() == ["rank", "score", "label", "path"]
    assert lines[2].split()[0] == "1" and lines[2].split()[2:] == ["class3", "class3/img2.png"]
    assert f"error: cannot read image {broken_image}" in table


def test_unlabelled_items_answer_label_none_after_a_reload(served, image_root, tmp_path):
    """A catalogue mixing labelled and unlabelled (folder) rows: pandas reads the nulls back as NaN."""
    from xbn.serving.index import CatalogueIndex

    frame, root = read_source(image_root / "manifest.csv")
    frame.loc[frame["path"].str.startswith("class5/"), "label"] = None
    build_catalogue(served, frame, root, IndexConfig()).save(tmp_path / "index")
    loaded = CatalogueIndex.load(tmp_path / "index")
    [result] = search_images(served, loaded, [image_root / "class5/img0.png"], k=1)
    assert result["results"][0] == {
        "path": "class5/img0.png",
        "label": None,
        "score": pytest.approx(1.0, abs=1e-4),
        "rank": 1,
        "row": 20,  # the manifest's order: 4 images of each of classes 0..4 come first
    }
    [result] = search_images(served, loaded, [image_root / "class4/img0.png"], k=1)
    assert result["results"][0]["label"] == "class4"
    assert "  1     1.0000  -      class5/img0.png" in format_table(
        search_images(served, loaded, [image_root / "class5/img0.png"], k=1)
    )
