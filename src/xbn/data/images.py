"""Opening an image file as the RGB picture the model sees: the one place every reader of image files goes through
(`ImageDataset` for training, evaluation and embedding; the retrieval grids of the tracking plots).

Transparency is composited on white: a transparent pixel of an RGBA, LA, PA or palette image (or of a grey or
RGB image with a transparent colour) becomes white, as an image viewer shows it, instead of whatever colour the
file happens to store under alpha 0 (often black). Going through RGBA also keeps PIL from warning "Palette
images with Transparency expressed in bytes should be converted to RGBA images".
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

BACKGROUND = (255, 255, 255)


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` as an RGB image, its transparent parts composited on white."""
    if not image.has_transparency_data:  # alpha modes, or a 'transparency' entry (palette, grey, RGB)
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def open_rgb(path: str | Path) -> Image.Image:
    """The image file at `path`, decoded and converted by `to_rgb` (the file is closed on return)."""
    with Image.open(path) as image:
        return to_rgb(image)
