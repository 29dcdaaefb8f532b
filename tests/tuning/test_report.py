"""params.tuned.yaml merges into a params file: values change, comments and layout stay, and the result still
validates."""

import shutil

import pytest
import yaml

from tests_support import ROOT
from xbn.config import load_params
from xbn.tuning import apply_tuned, set_yaml_values, write_tuned

TUNED = {"memory.kalman.r": 3.5e-05, "memory.kalman.q": 2.0, "memory.kalman.p0": 10000.0, "memory.size": 0.25,
         "memory.kalman.gain_interval": 10}


def test_merging_changes_exactly_the_tuned_lines_and_keeps_comments():
    text = (ROOT / "params.yaml").read_text()
    merged = set_yaml_values(text, TUNED)
    before, after = text.splitlines(), merged.splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == len(TUNED)
    size_line = next(b for _, b in changed if b.lstrip().startswith("size:"))
    old_size_line = next(a for a in before if a.lstrip().startswith("size:"))
    assert size_line.index("#") == old_size_line.index("#")  # the comment stays in its column
    p = yaml.safe_load(merged)["memory"]
    assert (p["kalman"]["r"], p["kalman"]["gain_interval"], p["size"]) == (3.5e-05, 10, 0.25)


def test_a_key_the_file_lacks_is_refused_not_guessed():
    with pytest.raises(KeyError, match=r"loss\.params\.margin"):
        set_yaml_values((ROOT / "params.yaml").read_text(), {"loss.params.margin": 0.3})


def test_tuned_file_is_a_params_fragment_and_apply_validates(tmp_path):
    summary = {"study": "s", "best": {"trial": 3, "value": 0.5, "epoch": 2, "overrides": TUNED},
               "current": {"value": 0.4}}
    assert write_tuned(tmp_path / "params.tuned.yaml", summary) == TUNED
    fragment = yaml.safe_load((tmp_path / "params.tuned.yaml").read_text())
    assert fragment == {"memory": {"kalman": {"r": 3.5e-05, "q": 2.0, "p0": 10000.0, "gain_interval": 10},
                                   "size": 0.25}}
    params_file = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params_file)
    apply_tuned(params_file, TUNED)
    k = load_params(params_file).memory.kalman
    assert (k.r, k.q, k.p0, k.gain_interval) == (3.5e-05, 2.0, 10000.0, 10)
    assert "# xbn parameters" in params_file.read_text()
