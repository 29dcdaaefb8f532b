"""`data.num_workers: auto`, the DataLoader options that go with the worker count (`xbn.data.loading`), and
forked workers that forget the thread-exit hooks of their parent."""

from __future__ import annotations

import pytest
from tests_support import ROOT

from xbn.config import ConfigError, load_params
from xbn.data import loading
from xbn.data.loading import loader_options, resolve_num_workers

from .fixtures import write_csv


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


@pytest.fixture(scope="module")
def fork_exit_codes(tmp_path_factory):
    """fork_exit_codes.py's report: plain and xbn DataLoader workers forked from a fresh interpreter that holds
    a thread-exit hook failing in a fork (the parent's state, and nothing else, is what the workers inherit)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = tmp_path_factory.mktemp("fork")
    write_csv(root)
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("fork_exit_codes.py")), str(root)],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_failing_inherited_exit_hook_kills_plain_dataloader_workers(fork_exit_codes):
    assert fork_exit_codes["plain"][1] == [1, 1]  # silently: the hook fails past the traceback printer


def test_xbn_loader_workers_forget_the_parents_exit_hooks(fork_exit_codes):
    assert fork_exit_codes["xbn"] == [list(range(8)), [0, 0]]
