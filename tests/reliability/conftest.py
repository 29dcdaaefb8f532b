"""Fixtures for the reliability tests: a tiny params.yaml written to disk, for the CLI run as a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests_support import ROOT, TINY
from xbn.config import apply_overrides


@pytest.fixture
def params_file(tmp_path, glyph_root, monkeypatch):
    """Write tmp_path/params.yaml (shipped params + TINY + overrides), chdir there; returns its path."""
    monkeypatch.chdir(tmp_path)

    def make(*overrides: str, name: str = "params.yaml") -> Path:
        raw = yaml.safe_load((ROOT / "params.yaml").read_text())
        raw = apply_overrides(raw, [*TINY, f"data.root={glyph_root}", *overrides])
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return path

    return make
