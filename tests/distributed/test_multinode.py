"""Training across machines: `xbn train --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT`, two "nodes" on
127.0.0.1 (two launches of 1 process each, gloo, torchrun's c10d rendezvous), against `xbn train --nproc 2` on
one node with the same data and seed. The three launches run at once, in one test: each starts processes that
import torch, and pytest-xdist's groups cannot keep two tests that share them on one worker (with pytest 9
`xdist_group` does not group)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests_support import ROOT, TINY, free_port

from xbn.cli import EXIT_CONFIG, main
from xbn.training.replicas import state_digest

pytestmark = pytest.mark.slow

# A memory that wraps around (36 rows, 4 global batches of 16) and whose AXBN Kalman state depends on the whole
# global batch: both must be the same on every rank for the runs to agree. 2 epochs (1 warm-up): the warm-up ->
# main switch re-wraps the model in DDP.
RUN = ["memory.method=axbn", "memory.size=36", "train.epochs=1", "train.drift_every=0"]  # off under DDP


def start_train(cwd: Path, overrides: list[str], *flags: str) -> subprocess.Popen:
    # One thread per process in every run: the same float operations in the same order (torchrun sets it only
    # for --nproc > 1), and no oversubscribed CPU.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    cwd.mkdir()
    return subprocess.Popen([sys.executable, "-m", "xbn.cli", "train", *flags, "--params", str(ROOT / "params.yaml"),
                             *(f"--set={o}" for o in overrides)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers: the session start_train began
        out, err = process.communicate()
    return process.returncode, out, err


@pytest.fixture
def torchrun_runs(glyph_root, tmp_path, monkeypatch) -> tuple[Path, dict[str, str]]:
    """(base, stdout by run): runs in base/node0, base/node1 (the two nodes, each with its own folder: its
    relative train.checkpoint_dir is its own, nothing shared but the data) and base/single (--nproc 2)."""
    from xbn.config import load_params
    from xbn.stages.prepare import prepare

    base = tmp_path
    monkeypatch.chdir(base)
    overrides = [*TINY, *RUN, f"data.root={glyph_root}", f"data.manifest={base / 'manifest.csv'}"]
    prepare(load_params(ROOT / "params.yaml", overrides))
    endpoint = f"127.0.0.1:{free_port()}"
    started = {f"node{r}": start_train(base / f"node{r}", overrides, "--nnodes", "2", "--node-rank", str(r),
                                       "--rdzv-endpoint", endpoint) for r in (0, 1)}
    started["single"] = start_train(base / "single", overrides, "--nproc", "2")
    done = {name: finish(p) for name, p in started.items()}
    for name, (code, _, err) in done.items():
        assert code == 0, f"{name}: {err[-3000:]}"
    return base, {name: out for name, (_, out, _) in done.items()}


def test_two_nodes_train_as_one_machine_with_two_processes(torchrun_runs):
    base, stdout = torchrun_runs
    # `xbn train --nproc 2` launched torchrun on one node: rank 0 printed the summary once and wrote the files.
    summary = json.loads(stdout["single"])
    assert summary["epochs"] == 2 and summary["iterations"] == 4
    assert json.loads((base / "single/metrics/train.json").read_text())["iterations"] == 4
    assert (base / "single/models/model.pt").exists() and (base / "single/models/last.pt").exists()

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
        for key, value in a[part].items():  # extra state holds tensors too (the memory's batch-mean sums)
            assert state_digest({key: value}) == state_digest({key: b[part][key]}), key
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
