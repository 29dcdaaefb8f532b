"""The embedded default dataset: Unicode glyphs rendered offline from the fonts bundled with matplotlib.

A fresh clone has no network, so `make run` trains on this set. Each class is one Unicode character drawn by
every font that has it; each image picks one of those fonts and adds a random affine warp, stroke weight,
blur, noise and lighting. Like Stanford Online Products it has few images per class and many look-alike
classes (accented letters, arrows, box drawing, Braille), and test classes are unseen in training.

Layout (read by the generic CSV reader):
    root/images/<class:04d>/<n>.png   grayscale, image_size x image_size
    root/labels.csv                   path,label,split  (path relative to root, label "0042")
    root/glyphs.json                  the generator's arguments and each class's character

`python -m xbn.data.glyphs OUT_DIR [--classes N ...]` runs the generator from the shell.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import shutil
import time
import unicodedata
import uuid
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from fontTools.agl import toUnicode
from fontTools.ttLib import TTFont
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from xbn.utils.io import write_json

# Bump when a change to the rendering or the class list changes the files: an existing set is then rebuilt.
GENERATOR_VERSION = 1

FONT_DIR = Path(matplotlib.get_data_path()) / "fonts" / "ttf"

# The first face of each family is its regular one, used to find look-alike characters. Left out: the
# DejaVu "Display" subsets (a few dozen glyphs), LastResort (a placeholder box for every code point),
# STIXNonUni (private-use code points), STIXSiz* (big variants of delimiters) and cmex10 (delimiter pieces).
FONT_FAMILIES: dict[str, tuple[str, ...]] = {
    "DejaVu Sans": ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf",
                    "DejaVuSans-BoldOblique.ttf"),
    "DejaVu Sans Mono": ("DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
                         "DejaVuSansMono-BoldOblique.ttf"),
    "DejaVu Serif": ("DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf",
                     "DejaVuSerif-BoldItalic.ttf"),
    "STIX": ("STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf"),
    "Computer Modern": ("cmr10.ttf", "cmb10.ttf", "cmss10.ttf", "cmti10.ttf", "cmtt10.ttf", "cmmi10.ttf",
                        "cmsy10.ttf"),
}
# matplotlib's BaKoMa Computer Modern fonts keep TeX's 8-bit encoding behind a nominally Unicode cmap
# (cmr10 draws a Gamma at U+00A1): their characters are read from the glyph names instead.
_TEX_ENCODED = frozenset(FONT_FAMILIES["Computer Modern"])

MIN_FONTS = 4  # faces per class, so that every class varies in style
MIN_FAMILIES = 2  # and in design, not only in weight and slant
_MIN_INK = 4 * 255  # a rendering with less ink than four full pixels at 24 px counts as blank
_DUPLICATE_RMS = 0.02  # RMS difference (0..1) under which two characters look the same (see _deduplicate)

EM_FRACTION = 0.7  # the font's em square spans this fraction of the image before the random scale
SUPERSAMPLE = 2  # render and warp at this multiple of the image size, then box-downsample


@dataclass(frozen=True)
class Glyph:
    """One class: a character and the fonts that draw it.

    `keys[i]` is the text to hand to `fonts[i]`: the character itself, except in the TeX-encoded
    Computer Modern fonts, where it is the code the font files the glyph under.
    """

    char: str
    fonts: tuple[str, ...]
    keys: tuple[str, ...]

    @property
    def codepoint(self) -> str:
        return f"U+{ord(self.char):04X}"

    @property
    def name(self) -> str:
        return unicodedata.name(self.char)


@functools.cache
def _font(file: str, size: int) -> ImageFont.FreeTypeFont:
    # The basic layout (no shaping) draws a lone character the same way whether or not libraqm is installed.
    return ImageFont.truetype(str(FONT_DIR / file), size, layout_engine=ImageFont.Layout.BASIC)


def _family_files() -> dict[str, tuple[str, ...]]:
    """The configured font files that this matplotlib ships, by family."""
    present = {p.name for p in FONT_DIR.glob("*.ttf")}
    return {fam: tuple(f for f in files if f in present) for fam, files in FONT_FAMILIES.items()}


def _font_chars(file: str) -> dict[str, str]:
    """Characters a font maps, each with the key that draws it; only letters, digits, punctuation and symbols
    that are their own NFKC form (styled copies such as U+1D400 MATHEMATICAL BOLD CAPITAL A, fullwidth forms
    or superscripts are another character in a different font, so they would duplicate a class)."""
    cmap = TTFont(str(FONT_DIR / file), lazy=True).getBestCmap() or {}
    chars: dict[str, str] = {}
    for code, glyph_name in sorted(cmap.items()):
        char = toUnicode(glyph_name) if file in _TEX_ENCODED else chr(code)
        if (len(char) == 1 and char not in chars and unicodedata.category(char)[0] in "LNPS"
                and unicodedata.normalize("NFKC", char) == char):
            chars[char] = chr(code)
    return chars


def _ink(file: str, key: str, size: int = 24) -> int:
    mask = _font(file, size).getmask(key)
    return int(np.asarray(mask, dtype=np.int64).sum()) if mask.size[0] and mask.size[1] else 0


def _thumbnails(glyphs: list[Glyph], file: str, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Renderings at `size` px in one font, placed as in the dataset (em-box centre), as rows in [0, 1];
    and the indices of the glyphs that font draws."""
    font = _font(file, round(size * 0.625))
    index = np.array([i for i, g in enumerate(glyphs) if file in g.fonts], dtype=np.int64)
    rows = np.zeros((len(index), size * size), dtype=np.float32)
    for row, i in enumerate(index):
        g = glyphs[i]
        img = Image.new("L", (size, size))
        ImageDraw.Draw(img).text((size / 2, size / 2), g.keys[g.fonts.index(file)], font=font, fill=255,
                                 anchor="mm")
        rows[row] = np.asarray(img, dtype=np.float32).ravel() / 255.0
    return rows, index


def _deduplicate(glyphs: list[Glyph], reference_fonts: list[str]) -> list[Glyph]:
    """Drop characters that look like an earlier one (Greek Alpha and Cyrillic A after Latin A).

    Two characters are duplicates when their renderings in some reference font they share are within
    `_DUPLICATE_RMS`: that font would draw two labels with the same picture. Below it: homoglyphs (Latin,
    Greek and Cyrillic capitals at 0) and near-copies (Greek pi vs Cyrillic pe, 0.019); above it the closest
    real distinctions (cedilla vs dot below, psili vs dasia, from 0.023). Earlier code points win.
    """
    close = np.zeros((len(glyphs), len(glyphs)), dtype=bool)
    for file in reference_fonts:
        rows, index = _thumbnails(glyphs, file)
        sq = (rows * rows).sum(1)
        d2 = rows @ rows.T  # squared distances, built in place: these are (classes x classes) arrays
        d2 *= -2.0
        d2 += sq[:, None]
        d2 += sq[None, :]
        close[np.ix_(index, index)] |= d2 < _DUPLICATE_RMS**2 * rows.shape[1]
    keep = np.ones(len(glyphs), dtype=bool)
    for i in range(len(glyphs)):
        if keep[i]:  # a kept character removes the later ones that look like it
            keep[i + 1 :] &= ~close[i, i + 1 :]
    return [g for g, k in zip(glyphs, keep) if k]


@functools.cache
def candidate_glyphs() -> tuple[Glyph, ...]:
    """Every character the bundled fonts can supply as a class, sorted by code point.

    A character qualifies when at least `MIN_FONTS` faces from `MIN_FAMILIES` families draw it with visible
    ink, and it does not look like a lower code point. The list depends only on matplotlib's font files.
    """
    families = _family_files()
    family_of = {f: fam for fam, files in families.items() for f in files}
    keys_by_font = {f: _font_chars(f) for f in family_of}

    def enough(fonts: list[str]) -> bool:
        return len(fonts) >= MIN_FONTS and len({family_of[f] for f in fonts}) >= MIN_FAMILIES

    glyphs = []
    for char in sorted(set().union(*keys_by_font.values())):
        fonts = [f for f in family_of if char in keys_by_font[f]]
        if enough(fonts):  # rendering is the slow part: only for characters that can still qualify
            fonts = [f for f in fonts if _ink(f, keys_by_font[f][char]) >= _MIN_INK]
            if enough(fonts):
                glyphs.append(Glyph(char, tuple(fonts), tuple(keys_by_font[f][char] for f in fonts)))
    return tuple(_deduplicate(glyphs, [files[0] for files in families.values() if files]))


def render_glyph(glyph: Glyph, image_size: int, rng: np.random.Generator) -> Image.Image:
    """One random grayscale rendering of `glyph`: dark ink on light paper, `image_size` px square.

    Random: the font, stroke weight, rotation (+-15 deg), shear, scale (0.75-1.15) and aspect, position,
    paper and ink levels, a lighting gradient, blur and pixel noise. The em box is centred (not the ink), so
    position and size still tell a full stop from a middle dot.
    """
    k = rng.integers(len(glyph.fonts))
    em = round(EM_FRACTION * image_size * SUPERSAMPLE)
    font = _font(glyph.fonts[k], em)
    stroke = int(rng.integers(0, max(1, round(0.025 * em)) + 1))
    angle = np.deg2rad(rng.uniform(-15, 15))
    shear = rng.uniform(-0.25, 0.25)
    scale = np.exp(rng.uniform(np.log(0.75), np.log(1.15)))
    aspect = np.exp(rng.uniform(-0.08, 0.08))
    jitter = rng.uniform(-0.1, 0.1, size=2)

    # Draw on a canvas just large enough, with the em-box centre (anchor "mm") at `origin`.
    left, top, right, bottom = font.getbbox(glyph.keys[k], anchor="mm", stroke_width=stroke)
    canvas = Image.new("L", (int(right - left) + 2, int(bottom - top) + 2))  # whole pixels (typed float)
    origin = np.array([1 - left, 1 - top], dtype=np.float64)
    ImageDraw.Draw(canvas).text(tuple(origin), glyph.keys[k], font=font, fill=255, anchor="mm",
                                stroke_width=stroke, stroke_fill=255)
    x0, y0, x1, y1 = canvas.getbbox() or (0, 0, 1, 1)

    rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    fwd = rot @ np.array([[1.0, shear], [0.0, 1.0]]) @ np.diag([scale * aspect, scale / aspect])
    corners = (np.array([[x0, y0], [x1, y0], [x0, y1], [x1, y1]]) - origin) @ fwd.T
    side = image_size * SUPERSAMPLE
    margin = 0.04 * side
    extent = (corners.max(0) - corners.min(0)).max()
    if extent > side - 2 * margin:  # wide arrows and tall integrals shrink to fit rather than get clipped
        fwd *= (side - 2 * margin) / extent
        corners *= (side - 2 * margin) / extent
    lo, hi = margin - corners.min(0), side - margin - corners.max(0)
    centre = np.clip(side / 2 + jitter * side, lo, np.maximum(lo, hi))

    inv = np.linalg.inv(fwd)  # PIL maps each output pixel back to the canvas
    shift = origin - inv @ centre
    mask = canvas.transform((side, side), Image.Transform.AFFINE,
                            (inv[0, 0], inv[0, 1], shift[0], inv[1, 0], inv[1, 1], shift[1]),
                            resample=Image.Resampling.BILINEAR).reduce(SUPERSAMPLE)

    blur = rng.uniform(0.0, 0.9)
    if blur > 0.2:
        mask = mask.filter(ImageFilter.GaussianBlur(blur))
    ink, paper = rng.uniform(0.0, 0.35), rng.uniform(0.65, 1.0)
    slope = rng.uniform(-0.15, 0.15, size=2)
    coords = np.linspace(-0.5, 0.5, image_size)
    paper_img = paper + slope[0] * coords[None, :] + slope[1] * coords[:, None]
    alpha = np.asarray(mask, dtype=np.float64) / 255.0
    img = paper_img * (1 - alpha) + ink * alpha
    img += rng.normal(0.0, rng.uniform(0.01, 0.08), size=img.shape)
    return Image.fromarray(np.round(np.clip(img, 0, 1) * 255).astype(np.uint8))


def _matches(root: Path, arguments: dict[str, int]) -> bool:
    try:
        meta = json.loads((root / "glyphs.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("version") == GENERATOR_VERSION and meta.get("arguments") == arguments


def _write_set(out: Path, glyphs: list[Glyph], splits: list[str], arguments: dict[str, int]) -> None:
    """Write every file of the set into the (empty, private) directory `out`; glyphs.json goes last."""
    rows = []
    for c, glyph in enumerate(glyphs):
        (out / "images" / f"{c:04d}").mkdir(parents=True)
        for n in range(arguments["images_per_class"]):
            rel = f"images/{c:04d}/{n}.png"
            rng = np.random.default_rng([arguments["seed"], c, n])
            render_glyph(glyph, arguments["image_size"], rng).save(out / rel, format="PNG")
            rows.append((rel, f"{c:04d}", splits[c]))
    with open(out / "labels.csv", "w", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(("path", "label", "split"))
        writer.writerows(rows)
    write_json(out / "glyphs.json", {
        "generator": "xbn.data.glyphs",
        "version": GENERATOR_VERSION,
        "arguments": arguments,
        "matplotlib": matplotlib.__version__,
        "candidates": len(candidate_glyphs()),
        "classes": [
            {"label": f"{c:04d}", "codepoint": g.codepoint, "char": g.char, "name": g.name,
             "split": splits[c], "fonts": list(g.fonts)}
            for c, g in enumerate(glyphs)
        ],
    })


def _sibling(root: Path, tag: str) -> Path:
    """A fresh hidden name beside `root`; created with mkdir, not mkdtemp, so the set gets the umask's
    permissions rather than 0700."""
    return root.parent / f".{root.name}.{tag}-{uuid.uuid4().hex[:12]}"


def _swap_into_place(new: Path, root: Path) -> None:
    """Rename the finished set `new` to `root`; an older set moves aside first and is deleted afterwards."""
    if not root.exists():
        os.rename(new, root)
        return
    old = _sibling(root, "old")
    os.rename(root, old)
    os.rename(new, root)
    shutil.rmtree(old, ignore_errors=True)


def generate_glyphs(root: str | Path, classes: int = 600, images_per_class: int = 6, image_size: int = 64,
                    seed: int = 0) -> Path:
    """Generate the glyph set at `root` and return `root`; do nothing if it already holds these arguments.

    Classes are `classes` characters spread evenly over `candidate_glyphs()` (the same characters for every
    seed); the seed shuffles them into two disjoint halves, `train` and `test` (an odd class goes to train),
    and draws every image from its own `numpy.random.default_rng([seed, class, n])`, so equal arguments give
    byte-identical files. The set is written into a temp directory beside `root` and renamed into place
    when complete, so a crash never leaves a partial set at `root`.
    Raises ValueError for arguments out of range, including more classes than the fonts supply, and
    FileExistsError (before any work) if `root` is a non-empty directory that is not a glyph set.
    """
    root = Path(root)
    arguments = {"classes": classes, "images_per_class": images_per_class, "image_size": image_size,
                 "seed": seed}
    if classes < 2 or images_per_class < 1 or image_size < 8 or seed < 0:
        raise ValueError(f"invalid glyph arguments {arguments}: need classes >= 2, images_per_class >= 1, "
                         "image_size >= 8 and seed >= 0")
    if _matches(root, arguments):
        return root
    if root.exists() and any(root.iterdir()) and not (root / "glyphs.json").exists():
        raise FileExistsError(f"{root} exists and is not a glyph set (it has no glyphs.json); refusing to "
                              "replace it: point data.root at a new or empty folder")
    candidates = candidate_glyphs()
    if classes > len(candidates):
        raise ValueError(f"requested {classes} glyph classes, but the matplotlib fonts supply only "
                         f"{len(candidates)} distinct characters")
    # Even spacing over the sorted list mixes scripts in proportion rather than taking the first block.
    glyphs = [candidates[i * len(candidates) // classes] for i in range(classes)]
    test = set(np.random.default_rng(seed).permutation(classes)[: classes // 2].tolist())
    splits = ["test" if c in test else "train" for c in range(classes)]

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(root, "tmp")
    tmp.mkdir()
    try:
        _write_set(tmp, glyphs, splits, arguments)
        _swap_into_place(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xbn.data.glyphs", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--classes", type=int, default=600)
    parser.add_argument("--images-per-class", type=int, default=6)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        root = generate_glyphs(args.out_dir, args.classes, args.images_per_class, args.image_size, args.seed)
    except (ValueError, FileExistsError) as exc:
        parser.exit(2, f"error: {exc}\n")
    print(f"glyph set at {root} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
