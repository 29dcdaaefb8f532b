"""Shared parsing of the whitespace-separated label files of the public benchmarks, with line numbers."""

from __future__ import annotations

from pathlib import Path

from xbn.data.errors import DatasetError

Row = tuple[int, list[str]]


def read_lines(path: Path) -> list[Row]:
    """The non-blank lines of `path`, split on runs of whitespace, with their 1-based line numbers."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"cannot read label file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return [(no, line.split()) for no, line in enumerate(text.splitlines(), 1) if line.strip()]


def table(lines: list[Row], columns: tuple[str, ...], path: Path, header: bool) -> list[Row]:
    """Check the header (when the format has one) and every row's field count; return the data rows."""
    if header:
        if not lines:
            raise DatasetError(f"{path}: empty file, expected the header '{' '.join(columns)}'")
        no, fields = lines[0]
        if tuple(fields) != columns:
            raise DatasetError(
                f"{path} line {no}: header is '{' '.join(fields)}', expected '{' '.join(columns)}'"
            )
        lines = lines[1:]
    for no, fields in lines:
        if len(fields) != len(columns):
            raise DatasetError(
                f"{path} line {no}: expected {len(columns)} fields ({' '.join(columns)}), got {len(fields)}"
            )
    return lines


def parse_int(text: str, path: Path, line_no: int, key: str) -> int:
    """`int(text)`, or a `DatasetError` naming the file, line and column."""
    try:
        return int(text)
    except ValueError:
        raise DatasetError(f"{path} line {line_no}: {key} {text!r} is not an integer") from None
