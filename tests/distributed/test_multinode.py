"""Training across machines: `xbn train --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT`, two "nodes" on
127.0.0.1 (two launches of 1 process each, gloo, torchrun's c10d rendezvous), against `xbn train --nproc 2` on
one node with the same data and seed (the launches: conftest.py's `torchrun_runs`)."""

import json

import pytest
import torch

from tests_support import ROOT
from xbn.cli import EXIT_CONFIG, main

pytestmark = pytest.mark.slow


@pytest.mark.xdist_group("torchrun")  # one worker launches `torchrun_runs` for both of its tests
def test_two_nodes_train_as_one_machine_with_two_processes(torchrun_runs):
    base, stdout = torchrun_runs
    # torchrun's c10d rendezvous numbers the nodes itself: the global rank 0 is on one of them, and it alone
    # wrote the checkpoints and metrics, in its own folder; the other node wrote none (it has no models/).
    writers = [n for n in ("node0", "node1") if (base / n / "models").exists()]
    assert len(writers) == 1, writers
    writer, other = writers[0], {"node0": "node1", "node1": "node0"}[writers[0]]
    assert {"last.pt", "model.pt"} <= {p.name for p in (base / writer / "models").iterdir()}
    assert not (base / other / "models").exists() and not (base / other / "metrics").exists()
    assert [json.loads(stdout[n])["iterations"] for n in (writer, "single")] == [4, 4]  # printed by rank 0 alone
    assert stdout[other] == ""
    # Only node 0's launcher (and the global rank 0) records the run's params.
    assert (base / "node0" / "reports" / "params.resolved.yaml").exists()
    assert (base / "node1" / "reports").exists() == (writer == "node1")

    # Both ranks of each run ended with the same weights and the same cross-batch memory, bit for bit.
    nodes = json.loads((base / writer / "metrics" / "train.json").read_text())["replicas"]
    single = json.loads((base / "single" / "metrics" / "train.json").read_text())["replicas"]
    for replicas in (nodes, single):
        assert replicas["world_size"] == 2 and replicas["identical"] is True
        assert len(set(replicas["weights_sha256"])) == len(set(replicas["memory_sha256"])) == 1
    # And the two-node run is the single-node one: same global ranks, same slices, same seeds, one thread per
    # process, so the same float operations in the same order: equal exactly, not only within a tolerance.
    assert nodes["weights_sha256"] == single["weights_sha256"]
    assert nodes["memory_sha256"] == single["memory_sha256"]
    a, b = (torch.load(base / n / "models" / "last.pt", weights_only=True) for n in (writer, "single"))
    assert a["iteration"] == b["iteration"] == 4
    for part in ("model", "criterion"):
        assert a[part].keys() == b[part].keys()
        for key, value in a[part].items():
            assert torch.equal(value, b[part][key]) if isinstance(value, torch.Tensor) else value == b[part][key], key
    assert len(a["criterion"]["memory.embedding_memory"]) == 36
    assert json.dumps(a["history"]["epochs"]) == json.dumps(b["history"]["epochs"])  # NaN-safe: val scores too


@pytest.mark.parametrize("flags, named", [
    (["--nnodes", "2", "--node-rank", "0"], "--rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"], "--node-rank"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400"], "--node-rank 2"),
    (["--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29400"], "--nnodes"),
])
def test_bad_node_flags_exit_2_naming_the_flag(tmp_path, monkeypatch, capsys, flags, named):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--params", str(ROOT / "params.yaml"), *flags]) == EXIT_CONFIG
    assert named in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing launched, nothing recorded


@pytest.mark.parametrize("endpoint", ["127.0.0.1", "127.0.0.1:", ":29400", "node0:http", "node0:70000"])
def test_a_bad_rendezvous_endpoint_is_refused(capsys, endpoint):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint])
    assert exit_.value.code == 2
    assert "--rdzv-endpoint" in capsys.readouterr().err
