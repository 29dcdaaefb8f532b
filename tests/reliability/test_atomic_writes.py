"""A write that dies half-way leaves the previous file as it was and no temp file: a later stage never reads a
truncated artifact."""

from __future__ import annotations

import json

import pytest
import torch

from xbn.utils.io import save_torch, write_json


class Unserializable:
    pass


def test_a_failed_json_write_keeps_the_previous_file_whole(tmp_path):
    path = tmp_path / "metrics" / "eval.json"
    write_json(path, {"recall@1": 0.5})
    # json.dumps fails on the last key, after the others were rendered: nothing reaches the target.
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json(path, {"a": 1, "b": list(range(10_000)), "z": Unserializable()})
    assert json.loads(path.read_text()) == {"recall@1": 0.5}
    assert sorted(p.name for p in path.parent.iterdir()) == ["eval.json"]


def test_a_checkpoint_write_killed_half_way_keeps_the_last_good_one(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_torch(path, {"epoch": 1, "w": torch.ones(1000)})
    real_save = torch.save

    def dies_half_way(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        with open(f, "r+b") as fh:  # a partial file on disk, then the process "dies"
            fh.truncate(100)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_torch(path, {"epoch": 2, "w": torch.zeros(1000)})
    state = torch.load(path, weights_only=True)
    assert state["epoch"] == 1 and torch.equal(state["w"], torch.ones(1000))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
