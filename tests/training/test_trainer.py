"""The training loop end to end on a tiny model: artifacts, resume, numerical faults."""

import csv
import json
from pathlib import Path

import pytest
import torch

from tests_support import recomputed_recall_at_1
from xbn.stages.evaluate import evaluate
from xbn.stages.prepare import prepare
from xbn.training.trainer import Trainer
from xbn.training import fit as train
from xbn.utils.errors import NonFiniteLossError


def test_train_writes_model_checkpoint_and_metrics(tiny_params):
    params = tiny_params("memory.method=axbn")
    prepare(params)
    summary = train(params, progress=False)
    assert summary["epochs"] == 3 and summary["iterations"] > 0
    for name in ("models/model.pt", "models/last.pt", "metrics/train.json", "metrics/train_steps.csv",
                 "metrics/train_epochs.csv"):
        assert Path(name).stat().st_size > 0, name
    written = json.loads(Path("metrics/train.json").read_text())
    assert written["method"] == "axbn"
    # The best epoch's val R@1 is the saved model's, recomputed by brute force, and the best of the epochs.
    assert written["best_val_recall@1"] == pytest.approx(recomputed_recall_at_1(params, "val"), abs=1e-12)
    epochs = list(csv.DictReader(Path("metrics/train_epochs.csv").open()))
    best_row = max(float(e["val_recall@1"]) for e in epochs[1:])
    assert written["best_val_recall@1"] == pytest.approx(best_row, abs=1e-5)
    steps = Path("metrics/train_steps.csv").read_text().splitlines()
    header = steps[0].split(",")
    for column in ("loss", "gain", "memory_std", "drift_mean", "drift_max"):
        assert column in header, column
    assert len(steps) - 1 == summary["iterations"]  # log_every=1
    # Issue 52: every step with the memory carries the memory path's figures (add_batch_loss: both losses).
    rows = [r for r in csv.DictReader(Path("metrics/train_steps.csv").open()) if int(r["epoch"]) > 1]
    assert rows and all(r["memory_loss"] and r["batch_loss"] and r["batch_cosine"] for r in rows)
    for r in rows:
        assert float(r["loss"]) == pytest.approx(float(r["memory_loss"]) + float(r["batch_loss"]), rel=1e-5)
        assert -1 <= float(r["batch_memory_cosine"]) <= 1 and 0 <= float(r["batch_mean_norm"]) <= 1

    metrics = evaluate(params)
    recomputed = recomputed_recall_at_1(params, "test")
    assert {"recall@1", "recall@10", "map@r", "r_precision", "nmi"} - set(metrics) == {"recall@10"}  # k=[1,2,4]
    assert json.loads(Path("metrics/eval.json").read_text())["recall@1"] == metrics["recall@1"]
    assert metrics["recall@1"] == pytest.approx(recomputed, abs=1e-12)
    assert "untrained" in metrics


def test_resumed_run_equals_uninterrupted_run(tiny_params, tmp_path):
    params = tiny_params("memory.method=xbn", "train.checkpoint_dir=full", "train.metrics_dir=full_metrics")
    prepare(params)
    full = Trainer(params, progress=False)
    full.fit()

    # Stop after two of three epochs (as a kill after the epoch-2 checkpoint would), then resume.
    part = tiny_params("memory.method=xbn", "train.epochs=1", "train.checkpoint_dir=part",
                       "train.metrics_dir=part_metrics")
    Trainer(part, progress=False).fit()
    resumed_params = tiny_params("memory.method=xbn", "train.checkpoint_dir=part", "train.metrics_dir=part_metrics")
    resumed = Trainer(resumed_params, progress=False)
    assert resumed.resume() and resumed.epoch == 2
    resumed.fit()

    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(full.criterion.memory.embedding_memory, resumed.criterion.memory.embedding_memory,
                               rtol=0, atol=0)
    assert full.criterion.memory.queue_idx == resumed.criterion.memory.queue_idx
    assert full.history.epochs[-1] == resumed.history.epochs[-1]


def test_nan_loss_stops_with_diagnostic_and_keeps_checkpoint(tiny_params):
    params = tiny_params("memory.method=xbm")
    prepare(params)
    trainer = Trainer(params, progress=False)
    trainer.fit()
    before = Path("models/last.pt").read_bytes()
    trainer.params.train.epochs = 3
    with torch.no_grad():
        trainer.model.head.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at epoch 4, iteration \d+ \(embeddings finite: False\)"):
        trainer.fit()
    assert Path("models/last.pt").read_bytes() == before


def test_axbn_auto_resumed_after_epoch_1_equals_uninterrupted_run(tiny_params):
    # No head warm-up, so the memory and its noise-adaptive filter are at work from the first step.
    run = ["memory.method=axbn_auto", "memory.size=24", "train.batch_size=8", "train.warmup_epochs=0"]
    params = tiny_params(*run, "train.checkpoint_dir=full", "train.metrics_dir=full_metrics")
    prepare(params)
    full = Trainer(params, progress=False)
    full.fit()

    # Stopped after epoch 1 of 2 (what a kill after the epoch-1 checkpoint leaves), then resumed.
    Trainer(tiny_params(*run, "train.epochs=1", "train.checkpoint_dir=part",
                        "train.metrics_dir=part_metrics"), progress=False).fit()
    saved = torch.load("part/last.pt", weights_only=True)["criterion"]
    assert int(saved["memory.moments.steps"]) > 0 and saved["memory.moments.relative_process_noise"].any()
    resumed = Trainer(tiny_params(*run, "train.checkpoint_dir=part", "train.metrics_dir=part_metrics"),
                      progress=False)
    assert resumed.resume() and resumed.epoch == 1
    resumed.fit()

    expected, got = full.criterion.state_dict(), resumed.criterion.state_dict()
    assert expected.keys() == got.keys() and any(k.startswith("memory.moments.") for k in expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
        else:  # queue pointer, fill flag, iteration counters, the inputs of the memory's tracked slots
            _assert_same(got[key], value, key)
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    assert resumed.history.steps == full.history.steps  # per-step loss, gain, memory moments
    # per-epoch loss and validation recall, exactly (json: the untrained row's loss is NaN, and NaN != NaN)
    assert json.dumps(resumed.history.epochs) == json.dumps(full.history.epochs)
    assert resumed.summary() == full.summary()


def _assert_same(got, expected, key: str) -> None:
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), key
        for k in expected:
            _assert_same(got[k], expected[k], f"{key}.{k}")
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=key)
    else:
        assert got == expected, key


def _checkpoint_of(params) -> Path:
    """The `last.pt` a run with `params` leaves after its first epoch (no training needed to write one)."""
    from xbn.utils.io import save_torch

    trainer = Trainer(params, progress=False)
    trainer.epoch = 1
    path = trainer.checkpoint_dir / "last.pt"
    save_torch(path, trainer._state())
    return path


def test_resume_refuses_a_checkpoint_trained_with_other_params(tiny_params):
    from xbn.config import ConfigError

    prepare(tiny_params())
    _checkpoint_of(tiny_params("train.seed=7", "memory.method=xbn"))
    trainer = Trainer(tiny_params(), progress=False)
    with pytest.raises(ValueError, match="trained with other params: 2 key") as caught:
        trainer.resume()
    message = str(caught.value)
    assert "memory.method: 'xbn' in the checkpoint, 'xbm' now" in message
    assert "train.seed: 7 in the checkpoint, 0 now" in message
    assert isinstance(caught.value, ConfigError) and trainer.epoch == 0  # nothing was loaded


def test_resume_accepts_keys_that_leave_the_weights_alone(tiny_params, caplog):
    prepare(tiny_params())
    _checkpoint_of(tiny_params("train.epochs=1", "data.num_workers=1", "eval.batch_size=8",
                               "tracking.experiment=elsewhere"))
    trainer = Trainer(tiny_params(), progress=False)
    with caplog.at_level("INFO", logger="xbn.training.trainer"):
        assert trainer.resume() and trainer.epoch == 1
    assert "data.num_workers, eval.batch_size, tracking.experiment, train.epochs" in caplog.text


def test_resume_past_train_epochs_says_what_happens(tiny_params, caplog):
    from xbn.utils.io import save_torch

    prepare(tiny_params())
    done = Trainer(tiny_params(), progress=False)  # a checkpoint 4 epochs in (as train.epochs=3 leaves)
    done.epoch = 4
    done.optimizer, done.scheduler = done._optimizer_for(4)  # past the warm-up: the main phase's optimizer
    save_torch(done.checkpoint_dir / "last.pt", done._state())
    trainer = Trainer(tiny_params("train.epochs=1"), progress=False)
    with caplog.at_level("WARNING", logger="xbn.training.trainer"):
        assert trainer.resume() and trainer.epoch == 4
    assert (f"{trainer.checkpoint_dir / 'last.pt'} has already completed 4 epochs, past the 2 this run asks for "
            f"(train.epochs=1 + train.warmup_epochs=1): nothing is trained") in caplog.text
    assert "set train.epochs to at least 4 to train further" in caplog.text
    assert trainer.fit()["epochs"] == 4  # and indeed nothing was trained


def test_resume_refuses_a_checkpoint_that_does_not_name_its_params(tiny_params):
    from xbn.utils.io import save_torch

    prepare(tiny_params())
    path = _checkpoint_of(tiny_params())
    state = torch.load(path, weights_only=True)
    for key in ("params", "params_hash", "flow_run_id"):  # what xbn wrote before it recorded them
        del state[key]
    save_torch(path, state)
    with pytest.raises(ValueError, match="does not record the params it was trained with"):
        Trainer(tiny_params(), progress=False).resume()


def test_cli_resume_with_other_params_exits_with_the_config_code(tiny_params, glyph_root, capsys):
    import yaml

    from tests_support import ROOT, TINY
    from xbn.cli import EXIT_CONFIG, main
    from xbn.config import apply_overrides

    prepare(tiny_params())
    _checkpoint_of(tiny_params("train.lr=0.5"))
    raw = apply_overrides(yaml.safe_load((ROOT / "params.yaml").read_text()), [*TINY, f"data.root={glyph_root}"])
    Path("params.yaml").write_text(yaml.safe_dump(raw))
    assert main(["train", "--resume", "-q"]) == EXIT_CONFIG
    assert "train.lr: 0.5 in the checkpoint, 0.0001 now" in capsys.readouterr().err


def test_checkpoint_records_the_params_hash_mlflow_tags_runs_with(tiny_params):
    from xbn.tracking.fingerprints import params_hash
    from xbn.training.trainer import checkpoint_identity

    params = tiny_params()
    prepare(params)
    path = _checkpoint_of(params)
    assert checkpoint_identity(path) == {"params_hash": params_hash(params), "flow_run_id": None, "epoch": 1}
    assert checkpoint_identity(path.with_name("absent.pt")) is None


def test_the_oracle_trains_on_rows_no_older_than_its_refresh_and_reports_the_memorys_drift(tiny_params):
    params = tiny_params("memory.method=oracle", "memory.oracle_every=2", "memory.exclude_self=true",
                         "train.drift_every=1", "train.warmup_epochs=0")
    prepare(params)
    trainer = Trainer(params, progress=False)
    summary = trainer.fit()
    checks = [s for s in trainer.history.steps if s.get("memory_rows_checked")]
    assert len(checks) == summary["iterations"]  # drift_every=1, log_every=1
    # Refreshed before every other step, measured after each: a row is at most 2 steps old.
    assert max(c["memory_age"] for c in checks) <= 2
    assert all(c["stored_drift_mean"] == c["mapped_drift_mean"] for c in checks)  # the oracle maps nothing
    header = Path("metrics/train_steps.csv").read_text().splitlines()[0].split(",")
    assert {"stored_drift_mean", "mapped_drift_mean", "memory_age", "scale_median"} <= set(header)
    written = json.loads(Path("metrics/train.json").read_text())["memory_drift"]
    assert written["checks"] == len(checks) and written["memory_age"] <= 2
