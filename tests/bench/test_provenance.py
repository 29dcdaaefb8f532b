"""benchmarks/provenance.py: a result names the commit it measured, so a dirty tree is refused (or marked), the
benchmarks' own outputs do not make a tree dirty, and write_result stores the record with UTC dates and loads."""

from __future__ import annotations

import datetime as dt
import json
import subprocess

import pytest
from benchmarks import common, provenance


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "memory.json").write_text("{}\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "first")
    return tmp_path


def test_clean_tree_records_its_commit(repo):
    run = provenance.begin(["python", "-m", "benchmarks", "memory"], repo=repo)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    record = run.finish()
    assert record["git_commit"] == head.strip() and record["dirty"] is False and record["dirty_paths"] == []
    assert record["command"] == "python -m benchmarks memory"
    started = dt.datetime.fromisoformat(record["started_utc"])
    assert started.utcoffset() == dt.timedelta(0)
    assert dt.datetime.fromisoformat(record["finished_utc"]) >= started
    assert isinstance(record["loadavg_1min_before"], float) and isinstance(record["loadavg_1min_after"], float)
    assert {"cpu", "cores", "cpu_flags", "packages"} <= set(record["machine"])


def test_dirty_tree_is_refused_unless_allowed(repo):
    (repo / "code.py").write_text("x = 2\n")
    with pytest.raises(provenance.DirtyTreeError, match=r"code\.py.*--allow-dirty"):
        provenance.begin(["bench"], repo=repo)
    record = provenance.begin(["bench"], repo=repo, allow_dirty=True).finish()
    assert record["dirty"] is True and record["dirty_paths"] == ["code.py"]


def test_a_staged_change_is_dirty_too(repo):
    (repo / "code.py").write_text("x = 3\n")
    _git(repo, "add", "code.py")
    with pytest.raises(provenance.DirtyTreeError):
        provenance.begin(["bench"], repo=repo)


def test_benchmark_outputs_do_not_make_the_tree_dirty(repo):
    # `python -m benchmarks all` writes one result, then begins the next benchmark
    (repo / "benchmarks" / "results" / "memory.json").write_text('{"rows": []}\n')
    assert provenance.begin(["bench"], repo=repo).finish()["dirty"] is False


def test_write_result_adds_the_current_runs_provenance(repo, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "out")
    provenance.begin(["python", "-m", "benchmarks", "eval"], repo=repo)
    path = common.write_result("eval", {"rows": [1]})
    saved = json.loads(path.read_text())
    assert saved["rows"] == [1] and saved["provenance"]["command"] == "python -m benchmarks eval"


def test_write_result_without_a_begun_run_says_how(monkeypatch):
    monkeypatch.setattr(provenance, "_current", None)
    with pytest.raises(RuntimeError, match="python -m benchmarks <name>"):
        provenance.finish()


def test_the_gpu_bench_without_cuda_keeps_a_measured_result(repo, tmp_path, monkeypatch):
    # `make bench` on a CPU machine must not replace what a lent GPU measured with 'not run'
    from benchmarks import gpu_bench

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(common, "RESULTS_DIR", out)
    monkeypatch.setattr(gpu_bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_bench, "machine_info", lambda packages: {})
    provenance.begin(["python", "-m", "benchmarks", "gpu"], repo=repo)

    assert gpu_bench.main([])["status"].startswith("not run")  # nothing measured yet: the record says so
    measured = {"status": "ok", "real_images_per_s": 900.0, "provenance": {"git_commit": "82e39e16"}}
    (out / "gpu.json").write_text(json.dumps(measured))
    assert gpu_bench.main([]) == measured
    assert json.loads((out / "gpu.json").read_text()) == measured
