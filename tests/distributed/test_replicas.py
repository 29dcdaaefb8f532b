"""What the ranks of a run on several nodes must share (`xbn.training.replicas`): each rank's facts come from
its own params and files; other params, another manifest or another last.pt on a rank are an error naming the
key or file and the ranks, while what a node may set for itself (where its copy lies) is not. The collective
around it runs in tests/distributed/test_multinode.py."""

import pytest
import torch
from torch import nn

from tests_support import ROOT, TINY
from xbn.config import ConfigError, load_params
from xbn.data import DatasetError
from xbn.training.replicas import disagreement, rank_facts, replica_report, state_digest

MANIFEST = "path,label,split\na/1.png,a,train\na/2.png,a,train\nb/1.png,b,train\n"


@pytest.fixture
def node(tmp_path):
    """`node(name, *overrides, resume=False)`: the facts of a rank on node `name`, whose folder holds its copy
    of the manifest and its models/last.pt (None: no such file)."""
    def make(name: str, *overrides: str, resume: bool = False, manifest: str | None = MANIFEST,
             last: bytes | None = b"ckpt"):
        home = tmp_path / name
        (home / "models").mkdir(parents=True, exist_ok=True)
        if manifest is not None:
            (home / "manifest.csv").write_text(manifest)
        if last is not None:
            (home / "models" / "last.pt").write_bytes(last)
        params = load_params(ROOT / "params.yaml", [*TINY, f"data.root={home / 'images'}",
                                                    f"data.manifest={home / 'manifest.csv'}",
                                                    f"train.checkpoint_dir={home / 'models'}", *overrides])
        return rank_facts(params, resume)
    return make


def test_nodes_with_their_own_copies_of_the_same_files_agree(node):
    assert disagreement([node("a"), node("b", "data.num_workers=3", "train.metrics_dir=elsewhere")]) is None
    assert disagreement([node("a", resume=True), node("b", resume=True)]) is None
    # Without --resume last.pt is not read, so an old one left on a node does not matter.
    assert disagreement([node("a"), node("b", last=b"another")]) is None


def test_other_params_on_a_node_name_the_key_and_the_ranks(node):
    error = disagreement([node("a"), node("b"), node("c", "train.seed=7")])
    assert isinstance(error, ConfigError)
    assert str(error).startswith("the nodes train with other params: train.seed: 0 on rank 0 (")
    assert "7 on rank 2 (" in str(error) and "same params file" in str(error)


def test_a_missing_or_different_manifest_names_the_file_and_the_rank(node, tmp_path):
    error = disagreement([node("a"), node("b", manifest=None)])
    assert isinstance(error, DatasetError)
    assert f"{tmp_path / 'b' / 'manifest.csv'} (missing) on rank 1" in str(error)
    assert "shared filesystem" in str(error)
    error = disagreement([node("a"), node("b", manifest=MANIFEST.replace("b/1.png", "b/9.png"))])
    assert isinstance(error, DatasetError) and str(error).count("sha256") == 2


def test_resuming_from_another_checkpoint_on_a_node_is_refused(node, tmp_path):
    error = disagreement([node("a", resume=True), node("b", resume=True, last=None)])
    assert isinstance(error, ConfigError) and str(error).startswith("--resume: last.pt differs between the nodes")
    assert f"{tmp_path / 'b' / 'models' / 'last.pt'} (missing) on rank 1" in str(error)
    assert "train.checkpoint_dir on a shared filesystem" in str(error)
    assert "--resume" in str(disagreement([node("a", resume=True), node("c", resume=True, last=b"older")]))


def test_the_replica_fingerprint_sees_the_smallest_drift():
    torch.manual_seed(0)
    memory = nn.BatchNorm1d(3)  # tensors and a counter in its state, like the cross-batch memory
    state = {k: v.clone() for k, v in memory.state_dict().items()}
    same = state_digest(state)
    assert state_digest({k: v.clone() for k, v in state.items()}) == same
    drifted = {**state, "running_mean": state["running_mean"] + torch.tensor([1e-7, 0, 0])}
    assert state_digest(drifted) != same
    assert state_digest({**state, "running_mean": state["running_mean"].double()}) != same  # the dtype counts
    assert state_digest({**state, "queue": 1}) != state_digest({**state, "queue": 2})  # extra state too
    ranks = [{"host": "a", "weights": "w", "memory": same}, {"host": "b", "weights": "w", "memory": same}]
    assert replica_report(ranks)["identical"] is True
    ranks[1]["memory"] = state_digest(drifted)
    report = replica_report(ranks)
    assert report["identical"] is False and report["hosts"] == ["a", "b"] and report["world_size"] == 2
