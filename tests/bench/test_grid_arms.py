"""benchmarks.grid's `--arm NAME BASE KEY=VALUE...`: a name already in the table is accepted only when it defines
the same arm (the commands stored in older results files, from before `xbm*_c` was a named method), and refused
when it would mean another one."""

import sys

import pytest
from tests_support import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import grid  # noqa: E402


def parse_error(capsys, *arm: str) -> str:
    """The grid's parser error for `--arm ARM` (an unknown --methods entry stops it after the arms are read)."""
    with pytest.raises(SystemExit):
        grid.main(["--arm", *arm, "--methods", "no-such-arm"])
    return capsys.readouterr().err


def test_a_named_arm_redefined_as_itself_is_accepted_and_as_another_is_refused(capsys):
    same = parse_error(capsys, "xbm*_c", "xbm*", "memory.center_gradient=true")
    assert "--methods: unknown no-such-arm" in same  # past the arm check
    other = parse_error(capsys, "xbm*_c", "xbm*", "memory.center_gradient=false")
    assert "--arm xbm*_c: the name is taken by another arm" in other
    assert "--methods: unknown" not in other
