"""Issue 26: one source of truth per run. The params a run's stages resolved are recorded
(reports/params.resolved.yaml) and its later stages read them; a later `--set` that contradicts them is
refused in one line; a stage's own keys still come from the params file (so `dvc repro` is unchanged)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from xbn.config import ConfigError, load_params
from xbn.config.record import RECORD, read_record, resolve_params, write_record
from xbn.stages.summary import summary_text
from tests_support import ROOT


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("params.yaml").write_text((ROOT / "params.yaml").read_text())  # the glyph default
    return tmp_path


RUN = ["data.dataset=folder", "data.root=/datasets/shapes", "memory.method=none"]


def run_until(stage: str, overrides=RUN) -> None:
    params = load_params("params.yaml", overrides)
    for name in ("prepare", "validate", "train", "refine", "evaluate", "register", "index"):
        write_record(params, name, "done", "params.yaml", overrides)
        if name == stage:
            return


def test_later_stages_read_the_runs_params_not_the_params_file(workdir):
    run_until("evaluate")
    params = resolve_params("params.yaml", [], "register")
    assert (params.data.dataset, params.data.root, params.memory.method) == ("folder", "/datasets/shapes", "none")
    assert resolve_params("params.yaml", [], None).data.dataset == "folder"  # summary
    # A stage's own keys, and keys no earlier stage used, come from the params file and its --set.
    own = resolve_params("params.yaml", ["registry.min_improvement=0.05", "data.num_workers=0"], "register")
    assert own.registry.min_improvement == 0.05 and own.data.num_workers == 0


def test_a_later_set_that_contradicts_the_run_is_refused_in_one_line(workdir):
    run_until("train")
    with pytest.raises(ConfigError) as err:
        resolve_params("params.yaml", ["memory.method=axbn"], "evaluate")
    message = str(err.value)
    assert "\n" not in message and "memory.method='axbn'" in message and "'none'" in message
    assert "xbn train" in message
    assert resolve_params("params.yaml", ["memory.method=none"], "evaluate").memory.method == "none"  # agrees
    # Before train ran, memory.method is train's own to choose.
    run_until("validate")
    assert resolve_params("params.yaml", ["memory.method=axbn"], "train").memory.method == "axbn"


def test_a_stage_drops_the_stages_after_it_and_is_recorded_atomically_as_yaml(workdir):
    run_until("index")
    write_record(load_params("params.yaml", RUN), "train", "failed", "params.yaml", RUN, reason="boom\nmore")
    record = yaml.safe_load(RECORD.read_text())
    assert list(record["stages"]) == ["prepare", "validate", "train"]
    assert record["stages"]["train"] == {**record["stages"]["train"], "status": "failed", "reason": "boom"}
    assert record["params"]["data"]["root"] == "/datasets/shapes" and read_record() is not None
    assert not list(RECORD.parent.glob("*.tmp"))


def test_the_summary_shows_this_runs_params_and_not_the_outputs_of_a_failed_stage(workdir):
    Path("metrics").mkdir()
    Path("metrics/train.json").write_text(json.dumps({"epochs": 14, "iterations": 9, "best_epoch": 3,
                                                      "best_val_recall@1": 0.9}))
    Path("metrics/eval.json").write_text(json.dumps({"recall@1": 0.7, "map@r": 0.4}))
    run_until("evaluate")
    text = summary_text(resolve_params("params.yaml", [], None))
    assert "folder at /datasets/shapes" in text and "none; batch 64 (16 classes x 4)" in text
    assert "R@1 0.7000" in text
    write_record(load_params("params.yaml", RUN), "train", "failed", "params.yaml", RUN,
                 reason="NonFiniteLossError: loss is nan")
    text = summary_text(resolve_params("params.yaml", [], None))
    assert re.search(r"FAILED +xbn train: NonFiniteLossError: loss is nan", text)
    assert "R@1 0.7000" not in text and "best epoch 3" not in text  # the previous run's files


def test_an_unknown_key_suggests_the_closest(workdir):
    with pytest.raises(ConfigError, match=r"unknown key 'train.epoch' \(did you mean 'train.epochs'\?\)"):
        load_params("params.yaml", ["train.epoch=3"])


def test_init_writes_a_params_file_for_a_dataset_that_loads_back(workdir, tmp_path):
    from xbn.stages.init import init

    Path("params.yaml").unlink()
    (tmp_path / "shapes").mkdir()
    init("folder", str(tmp_path / "shapes"), ["data.image_size=32", "memory.method=none"])
    params = load_params("params.yaml")
    assert (params.data.dataset, params.data.root) == ("folder", str(tmp_path / "shapes"))
    assert params.data.image_size == 32 and params.memory.method == "none"
    assert "# none | xbm | xbn | axbn | ema | axbn_auto" in Path("params.yaml").read_text()  # comments kept
    with pytest.raises(ConfigError, match="already exists"):
        init("folder", str(tmp_path / "shapes"))
    with pytest.raises(ConfigError, match="data.root: .*missing does not exist"):
        init("folder", str(tmp_path / "missing"), force=True)
