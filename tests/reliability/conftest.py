"""Fixtures for the reliability tests: a tiny params.yaml written to disk, for the CLI run as a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests_support import write_tiny_params


@pytest.fixture
def params_file(tmp_path, glyph_root, monkeypatch):
    """Write tmp_path/params.yaml (shipped params + TINY + overrides), chdir there; returns its path."""
    monkeypatch.chdir(tmp_path)

    def make(*overrides: str, name: str = "params.yaml") -> Path:
        return write_tiny_params(tmp_path / name, f"data.root={glyph_root}", *overrides)

    return make
