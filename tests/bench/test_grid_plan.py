"""benchmarks.grid.plan: a grid's cost is estimated before it starts, from earlier runs on the same machine kind."""

import json
import sys

from tests_support import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import grid  # noqa: E402


def test_the_plan_takes_the_median_of_matching_earlier_runs_and_says_when_it_cannot(tmp_path, monkeypatch):
    monkeypatch.setattr(grid, "RESULTS_DIR", tmp_path)
    run = {"dataset": "sop_like", "batch": 64, "cpu": "EPYC"}
    runs = [{**run, "method": "none", "train_s": s} for s in (100, 120, 500)]
    runs += [{**run, "method": "xbn", "train_s": 300}, {**run, "method": "none", "train_s": 9, "gpu": "H200"}]
    (tmp_path / "grid_x.json").write_text(json.dumps({"runs": runs}))
    keys = [{"dataset": "sop_like", "batch": 64, "method": m} for m in ("none", "xbn", "oracle")]
    # none: median 120; xbn: 300; oracle: the dataset and batch's median on this CPU (120 + 300 ... -> 210)
    planned = grid.plan(keys, workers=2, cpu="EPYC", device="cpu")
    assert planned["unknown_runs"] == 0
    assert planned["estimated_hours"] == round((120 + 300 + 210) / 2 / 3600, 2)
    assert grid.plan(keys, 2, cpu="Xeon", device="cpu")["estimated_hours"] is None  # nothing on this CPU
    assert grid.plan(keys[:1], 1, cpu="EPYC", device="cuda")["estimated_hours"] == round(9 / 3600, 2)
