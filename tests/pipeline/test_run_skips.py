"""`xbn run` keeps the retrain flow's rule (issue 24 item 2): in a DVC project, the same data and params as the
champion's train nothing; changed data, or --force, trains again. Real DVC, a real SQLite registry."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import yaml

from tests_support import ROOT, TINY

pytestmark = pytest.mark.slow


def test_xbn_run_trains_nothing_when_nothing_changed(tmp_path, glyph_root, monkeypatch, capsys):
    from xbn.cli import main

    monkeypatch.chdir(tmp_path)
    for args in (["init", "--no-scm", "-q"], ["remote", "add", "-d", "store", str(tmp_path / "remote")]):
        subprocess.run([sys.executable, "-m", "dvc", *args], check=True, capture_output=True)
    shutil.copytree(glyph_root / "images", tmp_path / "data" / "catalogue")
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    overrides = [o for o in TINY if not o.startswith(("tracking.enabled", "data.version"))]
    args = [f"--set={o}" for o in [*overrides, "data.dataset=folder", "data.root=data/catalogue",
                                   "data.version=dvc", "tracking.enabled=true", "train.epochs=1",
                                   f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]]
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    assert main(["run", *args]) == 0
    assert "v1 promoted" in capsys.readouterr().out
    assert main(["run", *args]) == 0
    out = capsys.readouterr().out
    assert "no change since v1" in out and "nothing retrained" in out
    report = yaml.safe_load((tmp_path / "reports/params.resolved.yaml").read_text())
    assert list(report["stages"]) == ["prepare"]  # stopped before validate and train

    # The retrain flow's plan on the same data: nothing to do, unless forced (then: fine-tune the champion).
    from xbn.config import load_params
    from xbn.data.snapshot import read_record
    from xbn.stages.schedule import plan

    params = load_params("params.yaml", [a.removeprefix("--set=") for a in args])
    assert not plan(params, read_record()).retrain
    forced = plan(params, read_record(), force=True)
    assert forced.retrain and forced.init == "champion" and forced.champion == 1
    assert forced.reason == "nothing changed, but the run was forced: fine-tuning champion v1"
    assert not forced.drift["embedding"]["tested"] and forced.drift["changes_line"] == "no change"

    # One image replaced in place: the bytes differ, so the run trains and registers again.
    victim = sorted((tmp_path / "data/catalogue").rglob("*.png"))[0]
    from PIL import Image

    with Image.open(victim) as image:
        changed = image.copy()
    changed.putpixel((0, 0), 128 if changed.getpixel((0, 0)) != 128 else 0)
    changed.save(victim)
    assert main(["run", *args]) == 0
    assert "v2" in capsys.readouterr().out
