"""Transparent images reach the model composited on white, from real PNG files written by PIL, and without PIL's
palette-transparency warning: `open_rgb` itself, `ImageDataset` (training, evaluation and embedding read through
it) and the retrieval grid of the tracking plots."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from xbn.data import ImageDataset
from xbn.data.images import open_rgb

WHITE, RED, GREEN = (255, 255, 255), (255, 0, 0), (0, 255, 0)
PALETTE_WARNING = "Palette images with Transparency expressed in bytes"


def rgba_png(path):
    """2x2 RGBA: (0,0) red under alpha 0, (1,0) opaque green, (0,1) red under alpha 128, (1,1) opaque red."""
    image = Image.new("RGBA", (2, 2))
    image.putdata([(*RED, 0), (*GREEN, 255), (*RED, 128), (*RED, 255)])
    image.save(path)
    return path


def palette_png(path):
    """2x2 palette image whose tRNS chunk gives several alphas (PIL reads it back as bytes): index 0 red with
    alpha 0, index 1 green opaque, index 2 red with alpha 128."""
    image = Image.new("P", (2, 2))
    image.putpalette([*RED, *GREEN, *RED] + [0] * (768 - 9))
    image.putdata([0, 1, 2, 1])
    image.save(path, transparency=bytes([0, 255, 128]))
    return path


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    assert [str(w.message) for w in caught] == []


def test_the_palette_file_is_the_case_that_warns(tmp_path):
    # The files below are the real trigger: PIL reads bytes transparency and warns on a direct RGB conversion.
    path = palette_png(tmp_path / "p.png")
    with Image.open(path) as image:
        assert image.mode == "P" and isinstance(image.info["transparency"], bytes)
        with pytest.warns(UserWarning, match=PALETTE_WARNING):
            assert image.convert("RGB").getpixel((0, 0)) == RED  # the hidden colour, not white


@pytest.mark.parametrize("write", [rgba_png, palette_png], ids=["rgba", "palette"])
def test_transparent_pixels_are_white(tmp_path, write, no_warnings):
    image = open_rgb(write(tmp_path / "t.png"))
    assert image.mode == "RGB" and image.size == (2, 2)
    assert image.getpixel((0, 0)) == WHITE  # alpha 0
    assert image.getpixel((1, 0)) == GREEN  # opaque: unchanged
    assert image.getpixel((0, 1)) == pytest.approx((255, 127, 127), abs=1)  # half red over white


def test_grey_with_alpha(tmp_path, no_warnings):
    Image.open(rgba_png(tmp_path / "rgba.png")).convert("LA").save(tmp_path / "la.png")
    with Image.open(tmp_path / "la.png") as check:
        assert check.mode == "LA"
    image = open_rgb(tmp_path / "la.png")
    assert image.getpixel((0, 0)) == WHITE and image.getpixel((1, 1)) == (76, 76, 76)  # opaque red as grey


def test_palette_with_alpha_channel(tmp_path, no_warnings):
    # PNG cannot store PA (PIL writes it as RGBA), so the decoded-image function is tested on one in memory.
    from xbn.data.images import to_rgb

    rgba = Image.open(rgba_png(tmp_path / "rgba.png"))
    pa = rgba.convert("RGB").quantize(4).convert("PA")
    pa.putalpha(rgba.getchannel("A"))
    assert pa.mode == "PA"
    image = to_rgb(pa)
    assert image.getpixel((0, 0)) == WHITE and image.getpixel((1, 0)) == GREEN


def test_grey_with_a_transparent_value(tmp_path, no_warnings):
    Image.fromarray(np.array([[0, 200], [200, 0]], dtype=np.uint8)).save(tmp_path / "g.png", transparency=0)
    image = open_rgb(tmp_path / "g.png")
    assert image.getpixel((0, 0)) == WHITE and image.getpixel((1, 0)) == (200, 200, 200)


def test_opaque_images_are_unchanged(tmp_path, no_warnings):
    Image.new("RGB", (3, 2), (10, 20, 30)).save(tmp_path / "rgb.png")
    Image.new("L", (3, 2), 7).save(tmp_path / "l.png")
    assert open_rgb(tmp_path / "rgb.png").getpixel((2, 1)) == (10, 20, 30)
    assert open_rgb(tmp_path / "l.png").getpixel((2, 1)) == (7, 7, 7)


def test_the_model_input_is_white_where_alpha_is_zero(tmp_path, no_warnings):
    rgba_png(tmp_path / "a.png")
    palette_png(tmp_path / "b.png")
    frame = pd.DataFrame({"path": ["a.png", "b.png"], "label": ["x", "y"]})
    dataset = ImageDataset(frame, tmp_path)  # the default transform: to_tensor, values in [0, 1]
    for index in range(2):
        tensor, _, _ = dataset[index]
        assert tensor[:, 0, 0].tolist() == [1.0, 1.0, 1.0]
        assert tensor[:, 0, 1].tolist() == [0.0, 1.0, 0.0]  # green stays green


def test_retrieval_grid_tiles_are_white_where_alpha_is_zero(tmp_path, no_warnings):
    from xbn.tracking.plots import retrieval_grid

    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(tmp_path / "clear.png")  # black, fully transparent
    Image.new("P", (8, 8), 0).save(tmp_path / "clear_p.png", transparency=bytes([0, 255]))
    retrieval_grid([tmp_path / "clear.png"], ["a"], [[tmp_path / "clear_p.png"]], [["a"]], tmp_path / "grid.png",
                   thumb=16, frame=5)
    grid = np.asarray(Image.open(tmp_path / "grid.png").convert("RGB"))
    # The tiles' insides (gap 6 and frame 5 before the query's; the neighbour's one cell and a 3-gap later).
    for x in (6 + 5, 6 + 26 + 18 + 5):
        assert (grid[11:27, x:x + 16] == 255).all(), "a transparent image was drawn in its hidden colour"


def test_a_fifo_or_a_nul_byte_is_unreadable_at_once(tmp_path):
    # Issue 41: Image.open on a FIFO blocked forever (a path inside the pyfunc's path_root); a NUL byte raised
    # ValueError where every caller catches OSError.
    import os

    os.mkfifo(tmp_path / "pipe.png")
    with pytest.raises(OSError, match="not a regular file"):
        open_rgb(tmp_path / "pipe.png")
    with pytest.raises(OSError, match="NUL byte"):
        open_rgb(f"{tmp_path}/a\0.png")
    with pytest.raises(OSError, match="not a regular file"):
        open_rgb(tmp_path)
