"""`python -m benchmarks all --since T`: a serial run of every benchmark that a stopped session left half done
goes on where it stopped, skipping each benchmark whose clean results file started at or after T."""

from __future__ import annotations

import datetime
import json

from benchmarks import __main__ as cli
from benchmarks import common


def _result(directory, stem, started, dirty=False):
    (directory / f"{stem}.json").write_text(json.dumps(
        {"rows": [], "provenance": {"started_utc": started, "dirty": dirty, "git_commit": "abc"}}))


def test_all_since_skips_what_was_measured_since_and_runs_the_rest(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(cli, "_has_cuda", lambda: False)
    _result(tmp_path, "memory_cpu", "2026-11-27T03:27:17+00:00")  # this campaign
    _result(tmp_path, "eval", "2026-11-26T13:12:00+00:00")  # an older one
    _result(tmp_path, "loader", "2026-11-27T04:00:00+00:00", dirty=True)  # a dirty tree's: measured again
    ran = []
    monkeypatch.setattr(cli, "NAMES", ("memory", "eval", "loader", "pipeline"))
    monkeypatch.setattr(cli, "run", lambda name, argv, allow_dirty=False: ran.append(name))

    assert cli.main(["all", "--since", "2026-11-27T03:20"]) == 0
    assert ran == ["eval", "loader", "pipeline", "report"]
    assert "memory: measured since 2026-11-27T03:20:00+00:00, skipped" in capsys.readouterr().out


def test_measured_since_compares_times_not_strings(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    _result(tmp_path, "grid", "2026-11-27T05:00:00+02:00")  # 03:00 UTC
    at = datetime.datetime(2026, 11, 27, 3, 20, tzinfo=datetime.timezone.utc)
    assert not cli.measured_since("grid", at)
    assert cli.measured_since("grid", at - datetime.timedelta(hours=1))
    assert not cli.measured_since("methods", at)  # no file: not measured


def test_a_bad_since_is_refused_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr(cli, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    assert cli.main(["all", "--since", "yesterday"]) == 2
    assert "--since needs a UTC time" in capsys.readouterr().err
