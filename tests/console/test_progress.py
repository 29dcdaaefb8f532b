"""The slow steps show a bar on a terminal, and nothing under DVC, a scheduler or a pipe, or with -q."""

import io
import sys

import pytest

from xbn.utils import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def loud():
    yield
    progress.set_quiet(False)


@pytest.mark.parametrize(("tty", "quiet", "shown"), [(True, False, True), (False, False, False),
                                                    (True, True, False)])
def test_a_bar_only_on_a_terminal_and_never_with_quiet(monkeypatch, tty, quiet, shown):
    err = Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    progress.set_quiet(quiet)
    assert list(progress.bar(range(5), "embed", unit="batch")) == list(range(5))
    assert ("embed" in err.getvalue()) == shown
