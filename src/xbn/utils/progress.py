"""Progress bars for the steps that can take more than a few seconds (each image decoded by validate, the
embedding passes of evaluate, index, register's gate and the drift report): on stderr, only when it is a
terminal (never under DVC, a scheduler or a pipe), and off with `-q` (the CLI calls `set_quiet`)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")
_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def bar(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterable[T]:
    """`items`, shown as a bar labelled `desc` while they are consumed (see the module docstring)."""
    return tqdm(items, desc=desc, total=total, unit=unit, leave=False, mininterval=1,
                disable=_quiet or not sys.stderr.isatty())
