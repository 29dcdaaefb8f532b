"""The embedded glyph set: layout, split, determinism, idempotence, atomicity and the character list."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import unicodedata
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from xbn.data import glyphs as glyphs_module
from xbn.data.glyphs import FONT_FAMILIES, MIN_FAMILIES, MIN_FONTS, candidate_glyphs, generate_glyphs, main

SMALL = {"classes": 20, "images_per_class": 3, "image_size": 32}


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _labels(root: Path) -> list[dict[str, str]]:
    with open(root / "labels.csv", newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def small_set(tmp_path_factory) -> Path:
    return generate_glyphs(tmp_path_factory.mktemp("glyphs") / "set", seed=0, **SMALL)


def test_layout_counts_and_labels(small_set: Path) -> None:
    rows = _labels(small_set)
    assert (small_set / "labels.csv").read_text().splitlines()[0] == "path,label,split"
    assert len(rows) == 20 * 3
    by_label = defaultdict(list)
    for row in rows:
        by_label[row["label"]].append(row["path"])
        assert row["path"] == f"images/{row['label']}/{Path(row['path']).name}"
    assert sorted(by_label) == [f"{c:04d}" for c in range(20)]
    for lab, paths in by_label.items():
        assert sorted(paths) == [f"images/{lab}/{n}.png" for n in range(3)]
    assert sorted(p.relative_to(small_set).as_posix() for p in small_set.rglob("*.png")) == sorted(
        r["path"] for r in rows)


def test_split_is_class_disjoint_halves(small_set: Path) -> None:
    splits = defaultdict(set)
    for row in _labels(small_set):
        splits[row["label"]].add(row["split"])
    assert all(len(s) == 1 for s in splits.values())
    per_split = defaultdict(int)
    for s in splits.values():
        per_split[s.pop()] += 1
    assert per_split == {"train": 10, "test": 10}


def test_images_decode_with_size_ink_and_differ_by_class(small_set: Path) -> None:
    images = defaultdict(list)
    for row in _labels(small_set):
        with Image.open(small_set / row["path"]) as img:
            assert img.format == "PNG" and img.mode == "L" and img.size == (32, 32)
            pixels = np.asarray(img, dtype=np.float64)
        # dark ink on lighter paper: a real glyph leaves a spread of gray levels, a blank image would not
        assert pixels.max() - pixels.min() > 60 and np.percentile(pixels, 1) < np.median(pixels) - 40
        images[row["label"]].append(pixels)
    means = np.stack([np.mean(v, axis=0) for _, v in sorted(images.items())])
    gaps = np.abs(means[:, None] - means[None]).mean(axis=(2, 3))
    assert gaps[~np.eye(len(means), dtype=bool)].min() > 1.0
    # images of one class are not copies of each other either (font, warp and noise are random)
    assert all(np.abs(v[0] - v[1]).mean() > 1.0 for v in images.values())


def test_metadata_names_each_class(small_set: Path) -> None:
    meta = json.loads((small_set / "glyphs.json").read_text())
    assert meta["arguments"] == {**SMALL, "seed": 0}
    assert meta["candidates"] == len(candidate_glyphs())
    splits = {row["label"]: row["split"] for row in _labels(small_set)}
    assert [c["label"] for c in meta["classes"]] == [f"{i:04d}" for i in range(20)]
    for entry in meta["classes"]:
        assert entry["codepoint"] == f"U+{ord(entry['char']):04X}"
        assert entry["name"] == unicodedata.name(entry["char"])
        assert entry["split"] == splits[entry["label"]]
    assert len({c["char"] for c in meta["classes"]}) == 20


def test_deterministic_per_seed(small_set: Path, tmp_path: Path) -> None:
    again = generate_glyphs(tmp_path / "again", seed=0, **SMALL)
    assert _digests(again) == _digests(small_set)
    other = _digests(generate_glyphs(tmp_path / "other", seed=1, **SMALL))
    pngs = [k for k in other if k.endswith(".png")]
    assert sum(other[k] != _digests(small_set)[k] for k in pngs) == len(pngs)
    assert other["labels.csv"] != _digests(small_set)["labels.csv"]  # the seed also reshuffles the split


def test_set_gets_umask_permissions(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        root = generate_glyphs(tmp_path / "set", classes=4, images_per_class=2, image_size=16)
    finally:
        os.umask(umask)
    assert root.stat().st_mode & 0o777 == 0o755  # not mkdtemp's 0700: other users and services can read it


def test_second_call_does_no_work(tmp_path: Path, monkeypatch) -> None:
    root = generate_glyphs(tmp_path / "set", seed=3, **SMALL)
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    monkeypatch.setattr(glyphs_module, "render_glyph", lambda *a, **k: pytest.fail("re-rendered"))
    assert generate_glyphs(root, seed=3, **SMALL) == root
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == stamps


def test_new_arguments_replace_the_old_set(tmp_path: Path) -> None:
    root = generate_glyphs(tmp_path / "set", seed=0, **SMALL)
    generate_glyphs(root, seed=0, classes=6, images_per_class=2, image_size=24)
    assert len(_labels(root)) == 12
    assert len(list(root.rglob("*.png"))) == 12  # nothing left over from the larger set
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]  # no temp or old directories


def test_crash_leaves_old_set_intact_and_no_debris(tmp_path: Path, monkeypatch) -> None:
    root = generate_glyphs(tmp_path / "set", seed=0, **SMALL)
    before = _digests(root)
    calls = {"n": 0}
    real = glyphs_module.render_glyph

    def crash_midway(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 10:
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(glyphs_module, "render_glyph", crash_midway)
    with pytest.raises(RuntimeError, match="simulated crash"):
        generate_glyphs(root, seed=5, **SMALL)
    assert _digests(root) == before
    calls["n"] = 0
    with pytest.raises(RuntimeError, match="simulated crash"):
        generate_glyphs(tmp_path / "fresh", seed=5, **SMALL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]


def test_refuses_to_replace_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a glyph set"):
        generate_glyphs(tmp_path / "mine", **SMALL)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_too_many_classes_says_how_many_exist(tmp_path: Path) -> None:
    available = len(candidate_glyphs())
    with pytest.raises(ValueError, match=rf"only {available} distinct"):
        generate_glyphs(tmp_path / "set", classes=available + 1, images_per_class=2, image_size=16)
    assert not (tmp_path / "set").exists()


@pytest.mark.parametrize("bad", [{"classes": 1}, {"images_per_class": 0}, {"image_size": 4}, {"seed": -1}])
def test_rejects_arguments_out_of_range(tmp_path: Path, bad: dict) -> None:
    with pytest.raises(ValueError, match="invalid glyph arguments"):
        generate_glyphs(tmp_path / "set", **{**SMALL, **bad})


def test_candidates_sorted_many_scripts_and_no_homoglyphs() -> None:
    cands = candidate_glyphs()
    chars = [g.char for g in cands]
    assert chars == sorted(set(chars)) and len(chars) >= 600
    scripts = {unicodedata.name(c).split()[0] for c in chars}
    assert {"LATIN", "GREEK", "CYRILLIC", "ARMENIAN", "GEORGIAN", "BRAILLE", "BOX"} <= scripts
    assert any("ARROW" in unicodedata.name(c) for c in chars)
    assert any(unicodedata.category(c) == "Sm" for c in chars)
    # Latin wins over its look-alikes; styled copies (mathematical bold A, fullwidth A) are not classes
    assert "A" in chars and "\u0391" not in chars and "\u0410" not in chars
    assert "\U0001d400" not in chars and "\uff21" not in chars
    assert "\u0394" in chars and "\u03b1" in chars  # Greek that differs from Latin stays


def test_every_class_drawn_by_enough_fonts_with_ink() -> None:
    family_of = {f: fam for fam, files in FONT_FAMILIES.items() for f in files}
    for g in candidate_glyphs():
        assert len(g.fonts) == len(g.keys) >= MIN_FONTS
        assert len({family_of[f] for f in g.fonts}) >= MIN_FAMILIES
    by_char = {g.char: g for g in candidate_glyphs()}
    # Computer Modern fonts are TeX-encoded: Gamma lives at the slot of U+00A1, and is drawn from there
    gamma = by_char["\u0393"]
    assert gamma.keys[gamma.fonts.index("cmr10.ttf")] == "\u00a1"


def test_command_line(tmp_path: Path, capsys) -> None:
    argv = [str(tmp_path / "cli"), "--classes", "4", "--images-per-class", "2", "--image-size", "16"]
    assert main(argv) == 0
    assert "glyph set at" in capsys.readouterr().out
    assert len(_labels(tmp_path / "cli")) == 8
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "cli2"), "--classes", "100000"])
    assert exc.value.code == 2 and "only" in capsys.readouterr().err
