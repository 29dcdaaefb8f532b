"""The options every command takes work after a command's action too (`xbn registry review --json`), without
resetting what was given before it; `--help` says the exit codes; `dir(xbn)` lists the lazy API."""

from __future__ import annotations

import pytest

from xbn.cli import build_parser


def test_common_options_after_the_action_and_before_it():
    parser = build_parser()
    after = parser.parse_args(["registry", "review", "--json", "--params", "p.yaml", "--set", "a=b"])
    assert after.json and after.params == "p.yaml" and after.overrides == ["a=b"]
    before = parser.parse_args(["registry", "--params", "p.yaml", "--set", "a=b", "promote", "--model-version", "2",
                                "--reason", "r"])
    assert before.params == "p.yaml" and before.overrides == ["a=b"] and not before.json  # not reset by the action
    restore = parser.parse_args(["data", "restore", "--model-version", "3", "--to", "d", "--params", "q.yaml"])
    assert restore.params == "q.yaml"


def test_help_says_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "exit codes: 0 done; 1 the run failed" in text and "4 a service the run needs cannot be reached" in text


def test_dir_lists_the_lazy_api():
    import xbn

    assert {"cross_batch_memory", "CrossBatchMemory", "load_params", "train"} <= set(dir(xbn))
