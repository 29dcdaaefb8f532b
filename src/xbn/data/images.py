"""Opening an image as the RGB picture the model sees: the one place every reader of images goes through
(`ImageDataset` for training, evaluation and embedding; `xbn search`; the HTTP server's uploads; the retrieval
grids of the tracking plots).

Untrusted input is expected: every failure of PIL on a file's bytes (it raises OSError, ValueError, SyntaxError,
struct.error, EOFError, ... depending on the plugin) becomes one `UnreadableImage` naming the file and the
reason, so a caller reports it per image and goes on. The size is checked on the header, before any pixel is
decoded, and `formats` restricts which of PIL's parsers run at all.

Transparency is composited on white: a transparent pixel of an RGBA, LA, PA or palette image (or of a grey or
RGB image with a transparent colour) becomes white, as an image viewer shows it, instead of whatever colour the
file happens to store under alpha 0 (often black). Going through RGBA also keeps PIL from warning "Palette
images with Transparency expressed in bytes should be converted to RGBA images".
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Collection
from pathlib import Path
from typing import Literal

from PIL import Image, UnidentifiedImageError

BACKGROUND = (255, 255, 255)
DEFAULT_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
# Modes `Image.reduce` refuses (it would average palette indices or bits): converted first.
_REDUCIBLE = {"P": "RGBA", "1": "L", "I;16": "I", "I;16B": "I", "I;16L": "I", "I;16N": "I"}


class UnreadableImage(OSError):
    """An image that cannot be used; the message names it and says why. `kind`: "unreadable" (its bytes),
    "too_large" (its pixel count, from the header) or "unsupported" (a format not allowed). An OSError, as
    PIL's own "cannot identify image file" is, so readers that skip unreadable files catch it the same way."""

    def __init__(self, message: str, kind: Literal["unreadable", "too_large", "unsupported"] = "unreadable"):
        super().__init__(message)
        self.kind = kind

    @property
    def too_large(self) -> bool:
        return self.kind == "too_large"


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` as an RGB image, its transparent parts composited on white."""
    if not image.has_transparency_data:  # alpha modes, or a 'transparency' entry (palette, grey, RGB)
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def open_image(
    source: str | Path | bytes,
    name: str | None = None,
    *,
    formats: Collection[str] | None = None,
    max_pixels: int | None = None,
    min_side: int | None = None,
) -> Image.Image:
    """The image at `source` (a path, or the bytes of an upload) opened, its pixels not yet decoded: the
    caller closes it (a `with` block) or passes it to `decode`. `name` is what messages call it (default
    "image <path>" or "upload"). `formats`: PIL format names accepted (None: any PIL reads); `max_pixels`:
    refused above it, from the header; `min_side`: a JPEG is set to decode at the smallest DCT scale that keeps
    both sides at least this large (`Image.draft`)."""
    name = _label(source, name)
    if isinstance(source, bytes) and not source:
        raise UnreadableImage(f"cannot read {name}: it is empty")
    if not isinstance(source, bytes):
        _check_regular_file(source, name)
    try:
        image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source,
                           formats=None if formats is None else list(formats))
    except FileNotFoundError:
        raise UnreadableImage(f"cannot read {name}: no such file") from None
    except Image.DecompressionBombError:
        assert Image.MAX_IMAGE_PIXELS is not None  # PIL raises it only under its limit
        raise UnreadableImage(_too_many(name, f"more than {2 * Image.MAX_IMAGE_PIXELS}", max_pixels),
                              "too_large") from None
    except UnidentifiedImageError:
        found = _identify(source) if formats is not None else None
        if found is not None and formats is not None:
            raise UnreadableImage(f"{found} images are not accepted here (accepted: {', '.join(formats)})",
                                  "unsupported") from None
        raise UnreadableImage(f"cannot read {name}: not an image format PIL can identify") from None
    except MemoryError:
        raise
    except Exception as exc:
        raise UnreadableImage(f"cannot read {name}: {_reason(exc)}") from exc
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        image.close()
        raise UnreadableImage(_too_many(name, f"{width}x{height}", max_pixels), "too_large")
    if min_side is not None and image.format == "JPEG":
        image.draft(None, (min_side, min_side))
    return image


def decode(image: Image.Image, name: str = "image", min_side: int | None = None) -> Image.Image:
    """The pixels of an `open_image` result as RGB (`to_rgb`), closing it. With `min_side`, an image at least
    twice that large on its shorter side is reduced by an integer factor (`Image.reduce`, a box average)
    straight after decoding, so the conversion works on the small copy; the shorter side stays >= min_side."""
    try:
        with image:
            image.load()  # decodes every pixel: a truncated or malformed file fails here, not later
            factor = min(image.size) // min_side if min_side else 1
            if factor >= 2:
                reducible = image.convert(_REDUCIBLE[image.mode]) if image.mode in _REDUCIBLE else image
                return to_rgb(reducible.reduce(factor))
            return to_rgb(image)
    except MemoryError:
        raise
    except Exception as exc:
        raise UnreadableImage(f"cannot read {name}: {_reason(exc)}") from exc


def _check_regular_file(path: str | Path, name: str) -> None:
    """A path from a manifest or a request is untrusted: a FIFO or a device would block `Image.open` forever,
    and a NUL byte raises ValueError where every caller expects an unreadable image."""
    try:
        mode = os.stat(path).st_mode
    except ValueError:
        raise UnreadableImage(f"cannot read {name!r}: the path holds a NUL byte") from None
    except FileNotFoundError:
        raise UnreadableImage(f"cannot read {name}: no such file") from None
    except OSError as exc:
        raise UnreadableImage(f"cannot read {name}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise UnreadableImage(f"cannot read {name}: not a regular file (a folder, a FIFO or a device)")


def open_rgb(
    source: str | Path | bytes,
    name: str | None = None,
    *,
    formats: Collection[str] | None = None,
    max_pixels: int | None = None,
    min_side: int | None = None,
) -> Image.Image:
    """`open_image` then `decode`: the image at `source` as RGB, or `UnreadableImage` naming it."""
    name = _label(source, name)
    image = open_image(source, name, formats=formats, max_pixels=max_pixels, min_side=min_side)
    return decode(image, name, min_side)


def _label(source: str | Path | bytes, name: str | None) -> str:
    """What messages call `source`: `name`, else "image <path>" or "upload"."""
    return name or (f"image {source}" if not isinstance(source, bytes) else "upload")


def _identify(source: str | Path | bytes) -> str | None:
    """The format `source` is in by PIL's identification (headers only), else by the magic bytes its plugins
    check (a refused format's parser may fail on a header it would name); None when neither knows it."""
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            return image.format
    except Exception:  # noqa: BLE001, S110 -- only asked to name the format in a refusal: try the magic bytes
        pass
    try:
        prefix = source[:16] if isinstance(source, bytes) else Path(source).read_bytes()[:16]
        return next(fmt for fmt in Image.ID if (accept := Image.OPEN[fmt][1]) is not None and accept(prefix) is True)
    except Exception:  # noqa: BLE001 -- unknown is an answer (StopIteration included)
        return None


def _too_many(name: str, pixels: str, limit: int | None) -> str:
    return f"{name} is {pixels} pixels, over the limit of {limit or Image.MAX_IMAGE_PIXELS} pixels"


def _reason(exc: BaseException) -> str:
    text = str(exc)
    if "truncated" in text.lower():
        return f"truncated image ({text})"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
