"""`python -m benchmarks all --since T`: a serial run of every benchmark that a stopped session left half done
goes on where it stopped, skipping each benchmark whose clean results file started at or after T."""

from __future__ import annotations

import datetime
import json

from benchmarks import __main__ as cli
from benchmarks import common, provenance


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
    monkeypatch.setattr(provenance, "settle", lambda: (0.4, 30.0))

    assert cli.main(["all", "--since", "2026-11-27T03:20"]) == 0
    assert ran == ["eval", "loader", "pipeline", "report"]
    out = capsys.readouterr().out
    assert "memory: measured since 2026-11-27T03:20:00+00:00, skipped" in out
    assert "== eval (1-minute load 0.4, after 30 s waiting for it to settle)" in out


def test_settle_waits_for_the_load_to_fall_and_gives_up_after_its_limit():
    loads, slept = iter([2.3, 1.6, 1.1, 0.8, 0.5]), []
    assert provenance.settle(1.0, 600, 10, load=lambda: next(loads), sleep=slept.append) == (0.8, 30.0)
    assert slept == [10, 10, 10]
    busy = []
    assert provenance.settle(1.0, 25, 10, load=lambda: 3.0, sleep=busy.append) == (3.0, 30.0)
    assert len(busy) == 3  # at most at_most_s (rounded up to a poll), then the benchmark starts anyway
    assert provenance.settle(1.0, load=lambda: 0.2, sleep=busy.append) == (0.2, 0.0) and len(busy) == 3


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
