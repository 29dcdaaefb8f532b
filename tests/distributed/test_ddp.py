"""Data-parallel training on 2 CPU processes (gloo) equals the single-process run on the same global
batches. `xbn train --nproc 2` (torchrun) is launched in test_multinode.py, beside the two-node run."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests_support import ROOT, TINY
from xbn.stages.prepare import prepare
from xbn.training.trainer import Trainer

pytestmark = pytest.mark.slow

# axbn: the Kalman state and R = r/|B| depend on the global batch; axbn_auto: so do R = s^2/|B| and the
# innovation test pooled over the dimensions. 3 epochs (1 warm-up) x 2 batches of 16; the 36-row memory wraps
# around; the warm-up -> main switch re-wraps the model in DDP.
METHODS = ["axbn", "axbn_auto"]
WORLD = 2
TOL = {"rtol": 1e-5, "atol": 1e-5}


def train_and_collect(params) -> dict:
    """Train, recording what the criterion saw and returned at every step and the final state."""
    trainer = Trainer(params, progress=False)
    steps: list[tuple[int, float]] = []
    trainer.criterion.register_forward_hook(
        lambda module, inputs, loss: steps.append((len(inputs[0]), loss.item())))
    trainer.fit()
    return {"local_rows": [n for n, _ in steps], "losses": [v for _, v in steps],
            "criterion": trainer.criterion.state_dict(), "model": trainer.model.state_dict(),
            "epochs": trainer.history.epochs, "logged_steps": len(trainer.history.steps)}


def worker(rank: int, workdir: str, init_file: str, overrides: list[str]) -> None:
    from xbn.config import load_params

    os.chdir(workdir)
    torch.set_num_threads(1)  # two processes on a shared CPU
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        result = train_and_collect(load_params(ROOT / "params.yaml", overrides))
        torch.save(result, Path(workdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def assert_states_equal(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, b[key], msg=key, **tol)
        elif isinstance(value, dict):  # extra state: queue pointer, fill flag, counters, batch-mean sums
            assert_states_equal(value, b[key], **tol)
        else:
            assert value == b[key], key


def epoch_table(result: dict) -> torch.Tensor:
    return torch.tensor([list(row.values()) for row in result["epochs"]], dtype=torch.float64)


@pytest.mark.parametrize("method", METHODS)
def test_ddp_loss_and_memory_equal_single_process(tiny_params, glyph_root, tmp_path, method):
    # The memory's drift measurement is off under DDP (a rank holds only its slice of the batch's images).
    run = [f"memory.method={method}", "memory.size=36", "train.drift_every=0"]
    single_params = tiny_params(*run)
    prepare(single_params)
    single = train_and_collect(single_params)

    overrides = [*TINY, f"data.root={glyph_root}", *run, "train.checkpoint_dir=ddp_models",
                 "train.metrics_dir=ddp_metrics"]
    mp.spawn(worker, args=(str(tmp_path), str(tmp_path / "init"), overrides), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    assert single["local_rows"] == [16] * 6
    assert len(single["criterion"]["memory.embedding_memory"]) == 36
    assert int(single["criterion"]["memory.moments.steps"]) > 0  # the moment filter ran
    for result in ranks:
        assert result["local_rows"] == [8] * 6  # each rank loaded half of every global batch
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single["losses"]), **TOL)
        assert_states_equal(result["criterion"], single["criterion"], **TOL)
        assert_states_equal(result["model"], single["model"], **TOL)  # so the gradients were the same too
        assert [list(e) for e in result["epochs"]] == [list(e) for e in single["epochs"]]  # val scores too
        torch.testing.assert_close(epoch_table(result), epoch_table(single), equal_nan=True, **TOL)
    # Both ranks hold the very same memory, Kalman state and model; rank 0 alone logged and wrote.
    assert ranks[0]["losses"] == ranks[1]["losses"]
    torch.testing.assert_close(epoch_table(ranks[0]), epoch_table(ranks[1]), equal_nan=True, rtol=0, atol=0)
    assert_states_equal(ranks[0]["criterion"], ranks[1]["criterion"], rtol=0, atol=0)
    assert_states_equal(ranks[0]["model"], ranks[1]["model"], rtol=0, atol=0)
    assert (ranks[0]["logged_steps"], ranks[1]["logged_steps"]) == (6, 0)
    assert Path("ddp_models/model.pt").exists() and Path("ddp_metrics/train.json").exists()


def test_ddp_keeps_the_mpn_weights_identical_on_every_rank(tiny_params, glyph_root, tmp_path):
    # The MPN trains inside the criterion, outside the DDP module; each rank draws its own dropout masks
    # (model.mpn.dropout 0.1), so only averaging its gradients keeps the ranks' MPNs equal.
    run = ["memory.method=none", "model.mpn.enabled=true", "train.epochs=1"]
    prepare(tiny_params(*run))
    overrides = [*TINY, f"data.root={glyph_root}", *run, "train.checkpoint_dir=ddp_models",
                 "train.metrics_dir=ddp_metrics"]
    mp.spawn(worker, args=(str(tmp_path), str(tmp_path / "init"), overrides), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    # The weights (the BatchNorm neck's running statistics follow each rank's own dropout and stay apart).
    weights = [{k: v for k, v in r["criterion"].items() if k.startswith("mpn_loss.") and "running_" not in k
                and "num_batches" not in k} for r in ranks]
    assert any(k.startswith("mpn_loss.mpn.layers.0.self_attn") for k in weights[0])
    assert_states_equal(weights[0], weights[1], rtol=0, atol=0)
    assert_states_equal(ranks[0]["model"], ranks[1]["model"], rtol=0, atol=0)
    assert ranks[0]["local_rows"] == [8] * 4  # 2 epochs (1 warm-up) x 2 global batches of 16, half each
    # And it trained: the MPN left its initialisation (the same seed on both ranks builds the same one).
    torch.manual_seed(0)
    fresh = Trainer(tiny_params(*run), progress=False).criterion.state_dict()
    assert not torch.equal(fresh["mpn_loss.mpn.layers.0.linear1.weight"],
                           weights[0]["mpn_loss.mpn.layers.0.linear1.weight"])
