"""`dvc repro` end to end on a tiny copy of the project: stages run in order, a second repro is a no-op, and
experiments and metrics commands work."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests_support import ROOT, recomputed_recall_at_1, write_tiny_params

pytestmark = pytest.mark.slow


def run(cmd, cwd, env):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


@pytest.fixture
def project(tmp_path):
    for name in ("dvc.yaml", ".dvcignore"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    write_tiny_params(tmp_path / "params.yaml", "tracking.enabled=true")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    env.pop("XBN_PARENT_RUN_ID", None)
    run(["git", "init", "-q"], tmp_path, env)
    run(["dvc", "init", "-q"], tmp_path, env)
    (tmp_path / ".gitignore").write_text("mlflow.db\nmlartifacts/\nmlruns/\n")
    run(["git", "add", "-A"], tmp_path, env)
    run(["git", "commit", "-qm", "init"], tmp_path, env)
    return tmp_path, env


def test_dvc_repro_end_to_end_then_noop(project, monkeypatch):
    from xbn.config import load_params

    path, env = project
    out = run(["dvc", "repro"], path, env)
    for stage in ("generate", "prepare", "validate", "train", "refine", "evaluate", "register", "index"):
        assert f"Running stage '{stage}'" in out, stage
    metrics = json.loads((path / "metrics/eval.json").read_text())
    assert "map@r" in metrics
    monkeypatch.chdir(path)  # the project's relative data and model paths
    assert metrics["recall@1"] == pytest.approx(
        recomputed_recall_at_1(load_params("params.yaml"), "test"), abs=1e-12)  # brute force, from model.pt
    decision = json.loads((path / "reports/registry.json").read_text())
    # The first model: promoted by the gate, champion once the index stage attached its index (promote last).
    assert decision["decision"] == "promoted" and decision["registration"] == "awaiting_index"
    assert json.loads((path / "reports/validation.json").read_text())["success"] is True
    index = json.loads((path / "metrics/index.json").read_text())  # flat: exact, so recall@10 is 1
    assert index["version"] == decision["version"] and index["recall@10"] == 1.0 and index["count"] > 0
    assert index["champion"] is True

    again = run(["dvc", "repro"], path, env)
    assert "Running stage" not in again and "up to date" in again

    shown = run(["dvc", "metrics", "show"], path, env)
    assert "recall@1" in shown
    run(["git", "add", "-A"], path, env)
    run(["git", "commit", "-qm", "baseline"], path, env)
    # Up to train: the experiment's metrics (train.json), without evaluating or registering it (the stages after
    # train ran above; each is another process that imports torch).
    out = run(["dvc", "exp", "run", "-S", "memory.method=xbn", "train"], path, env)  # the default is xbm
    assert "Running stage 'train'" in out and "Running stage 'prepare'" not in out
    assert "Running stage 'evaluate'" not in out and "Running stage 'register'" not in out
    diff = run(["dvc", "metrics", "diff"], path, env)
    assert "method" in diff and "xbn" in diff  # the experiment's metrics against the committed baseline
