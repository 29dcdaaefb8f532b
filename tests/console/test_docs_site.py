"""The docs site (mkdocs.yml): it builds with --strict (a broken link or anchor, a page outside the nav, an API
reference that no longer resolves fails), and its command-line page is what the parser prints."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from tests_support import ROOT


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_page_is_what_the_parser_prints():
    hooks = _hooks()
    assert hooks.CLI_PAGE.read_text() == hooks.cli_reference(), "run `python docs/hooks.py` and commit docs/cli.md"


def test_the_site_builds_strict(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    site = tmp_path / "site"
    assert "xbn registry promote" in (site / "cli" / "index.html").read_text()
    assert "cross_batch_memory" in (site / "api" / "index.html").read_text()  # mkdocstrings resolved it
    assert "compose" in (site / "operations" / "index.html").read_text()  # infra/README.md, included
