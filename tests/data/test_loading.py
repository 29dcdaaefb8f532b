"""`data.num_workers: auto` and the DataLoader options that go with the worker count (`xbn.data.loading`)."""

from __future__ import annotations

import pytest
from tests_support import ROOT

from xbn.config import ConfigError, load_params
from xbn.data import loading
from xbn.data.loading import loader_options, resolve_num_workers


def test_auto_is_the_usable_cores_less_one_capped_and_shared_by_the_local_processes(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for cores, workers in ((1, 0), (2, 1), (4, 3), (16, 8), (64, 8)):
        monkeypatch.setattr(loading, "usable_cores", lambda cores=cores: cores)
        assert resolve_num_workers("auto") == workers
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(loading, "usable_cores", lambda: 16)
    assert resolve_num_workers("auto") == 3  # 16 cores, 4 processes: 4 each, one of them the trainer
    assert resolve_num_workers(5) == 5
    with pytest.raises(ValueError, match="auto"):
        resolve_num_workers("many")


def test_usable_cores_follow_the_affinity_mask():
    import os

    if hasattr(os, "sched_getaffinity"):
        assert loading.usable_cores() == len(os.sched_getaffinity(0))


def test_loader_options():
    assert loader_options(0, "cpu") == {"num_workers": 0, "pin_memory": False}
    assert loader_options(2, "cuda") == {"num_workers": 2, "pin_memory": True, "persistent_workers": True,
                                         "prefetch_factor": 4}
    assert loader_options(8, "cpu")["prefetch_factor"] == 2  # 8 workers x 2 already queue 16 batches
    assert "prefetch_factor" not in loader_options(3, "cpu", persistent=False, queued_batches=None)


def test_params_accept_auto_or_a_number_and_refuse_the_rest():
    params = load_params(ROOT / "params.yaml")
    assert params.data.num_workers == "auto" and params.data.cache == "auto"
    assert load_params(ROOT / "params.yaml", ["data.num_workers=3"]).data.num_workers == 3
    assert load_params(ROOT / "params.yaml", ["data.cache=false"]).data.cache is False
    for bad in ("data.num_workers=true", "data.num_workers=-1", "data.num_workers=fast", "data.cache=maybe",
                "data.augment_on=gpu", "data.cache_max_gb=0"):
        with pytest.raises(ConfigError):
            load_params(ROOT / "params.yaml", [bad])
