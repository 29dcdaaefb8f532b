"""The Prefect retrain flow, for real, under prefect_test_harness on a tiny dataset."""

import json
from pathlib import Path

import pytest

from tests_support import ROOT, TINY

pytestmark = pytest.mark.slow


def test_the_flow_tunes_then_trains_with_the_best_trial_and_continues_the_study(prefect_harness, tmp_path,
                                                                                 glyph_root, monkeypatch):
    """Issue 14: validate -> tune -> train with the best trial's values -> evaluate -> register; the tuned values
    are on the run, params.yaml is untouched, and the next run continues the same study instead of restarting."""
    import optuna
    from mlflow.tracking import MlflowClient

    from xbn.flows.retrain import retrain

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    shipped = (ROOT / "params.yaml").read_text()
    (tmp_path / "params.yaml").write_text(shipped)
    overrides = [*TINY, f"data.root={glyph_root}", "tracking.enabled=true", "tune.trials=2", "tune.epochs=1",
                 "tune.pruner=none"]

    first = retrain("params.yaml", overrides, tune=True)
    tuned = first["tuned"]["values"]
    assert tuned and set(tuned) >= {"memory.method", "memory.size"}
    assert json.loads(Path("metrics/train.json").read_text())["method"] == tuned["memory.method"]
    run = MlflowClient(uri).get_run(Path("reports/run_id").read_text().strip())
    assert run.data.tags["tuned_study"] == first["tuned"]["study"]
    assert json.loads(run.data.tags["tuned_values"]) == tuned
    assert run.data.params["memory.method"] == tuned["memory.method"]
    assert (tmp_path / "params.yaml").read_text() == shipped  # tuned values are not written back unasked
    assert first["decision"]["decision"] == "promoted"

    second = retrain("params.yaml", overrides, tune=True)
    assert second["tuned"] == first["tuned"]  # the same study, already at tune.trials: nothing re-run
    study = optuna.load_study(study_name=first["tuned"]["study"], storage="sqlite:///tuning/optuna.db")
    assert len(study.trials) == 2


def test_bad_data_fails_the_flow_without_retrying(prefect_harness, tmp_path, glyph_root, monkeypatch):
    import shutil

    from xbn.flows.retrain import retrain
    from xbn.validation import ValidationFailed

    monkeypatch.chdir(tmp_path)
    broken = tmp_path / "glyphs"
    shutil.copytree(glyph_root, broken)
    victim = sorted((broken / "images").rglob("*.png"))[0]
    victim.write_bytes(b"not a png")
    with pytest.raises(ValidationFailed, match="image_decodes"):
        retrain(str(ROOT / "params.yaml"), [*TINY, f"data.root={broken}"])
    assert "image_decodes" in Path("reports/validation.md").read_text()
    assert not Path("models/model.pt").exists()


def test_a_misspelt_name_fails_the_flow_once_it_plans_to_train_before_validating(prefect_harness, tmp_path,
                                                                                 glyph_root, monkeypatch):
    """The flow resolves the params' names (loss, miner, backbone) only when its plan trains, so that a week with
    nothing changed imports neither pytorch-metric-learning nor timm; a bad name still fails the run before the
    data is validated or a model trained, naming the key."""
    from xbn.config import ConfigError
    from xbn.flows.retrain import retrain

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="loss.name"):
        retrain(str(ROOT / "params.yaml"), [*TINY, f"data.root={glyph_root}", "loss.name=MultiSimilarityLos"])
    assert Path("data/manifest.csv").exists()  # it had prepared the data: the check came after the plan
    assert not Path("reports/validation.json").exists() and not Path("models/model.pt").exists()


def test_a_retrain_refused_by_the_run_lock_is_reported_as_refused_not_failed(prefect_harness, tmp_path, receiver,
                                                                             monkeypatch):
    from prefect import flow

    from xbn.flows import retrain as retrain_flow
    from xbn.utils.locks import RunBusy

    url, received = receiver
    monkeypatch.setenv("XBN_NOTIFY_URLS", url)

    # The retrain flow's own failure hook, on a flow that meets the lock as `retrain` does (`pipeline_lock`).
    @flow(on_failure=[retrain_flow._notify_failure])
    def busy(params_path: str) -> None:
        raise RunBusy("xbn retrain: another run on xbn-embedder is in progress; this one did not start")

    @flow(on_failure=[retrain_flow._notify_failure])
    def broken(params_path: str) -> None:
        raise RuntimeError("disk full")

    for run in (busy, broken):
        assert run(str(ROOT / "params.yaml"), return_state=True).is_failed()
    titles = [m["title"] for m in received]
    assert [t.split(":")[0] for t in titles] == ["xbn retrain REFUSED", "xbn retrain FAILED"], titles
    assert "nothing was changed" in received[0]["message"] and "another run" in received[0]["message"]


@pytest.mark.parametrize("stale", [False, True], ids=["own-checkpoint", "stale-checkpoint"])
def test_a_retried_train_task_resumes_only_its_own_checkpoint(prefect_harness, tmp_path, glyph_root, monkeypatch,
                                                               stale):
    """A retry continues from the checkpoint its own flow run wrote; a models/last.pt left by another run (here a
    finished one, outside any flow run, as `make run` leaves it) is trained over from scratch, not reported as
    this run's result after 0 epochs (issue 14)."""
    import torch
    from prefect import flow

    from xbn.flows.retrain import train_model
    from xbn.config import load_params
    from xbn.stages.prepare import prepare
    from xbn.training.trainer import Trainer, params_hash

    monkeypatch.chdir(tmp_path)
    params = load_params(ROOT / "params.yaml", [*TINY, f"data.root={glyph_root}"])
    prepare(params)
    uninterrupted = train_model.fn(params)  # the same run in one go, for comparison
    assert torch.load("models/last.pt", weights_only=True)["flow_run_id"] is None
    if not stale:
        Path("models/last.pt").unlink()
    train_epoch, started = Trainer._train_epoch, []
    fail_at = [0] if stale else [0, 1]  # stale: before this run writes any checkpoint of its own

    def blinks_once(self):  # the disk goes away during an epoch of the first attempt
        started.append(self.epoch)
        if started == fail_at:
            raise OSError("the disk blinked")
        return train_epoch(self)

    monkeypatch.setattr(Trainer, "_train_epoch", blinks_once)

    @flow
    def only_train():
        from prefect.runtime import flow_run

        return flow_run.id, train_model.with_options(retry_delay_seconds=0)(params)

    run_id, summary = only_train()
    # own: the retry resumed at the failed epoch; stale: it started over at 0 instead of adopting epoch 3.
    assert started == ([0, 0, 1, 2] if stale else [0, 1, 1, 2])
    assert summary["epochs"] == uninterrupted["epochs"] == 3
    assert summary["best_val_recall@1"] == uninterrupted["best_val_recall@1"]
    state = torch.load("models/last.pt", weights_only=True)
    assert state["flow_run_id"] == str(run_id) and state["params_hash"] == params_hash(params)


def test_dataloader_workers_survive_inside_a_flow_run(prefect_harness, glyph_root):
    """Issue 14: inside a flow run the process holds Prefect's log and event services, whose thread-exit hooks a
    forked DataLoader worker inherited and failed on at exit (exit code 1, every pass, under the worker too)."""
    import numpy as np
    import torch
    from prefect import flow, task

    from xbn.data import read_dataset
    from xbn.evaluation.embed import image_loader

    @task
    def load_all() -> tuple[int, list]:
        frame = read_dataset("glyphs", glyph_root)
        loader = image_loader(frame, glyph_root, np.arange(len(frame)), None, batch_size=32, num_workers=2,
                              device=torch.device("cpu"))
        batches = iter(loader)
        loaded = sum(len(labels) for _, labels, _ in batches)
        # Read the exit codes directly: the DataLoader reports a dead worker only if its SIGCHLD lands in a wait.
        return loaded, [w.exitcode for w in batches._workers]

    @flow
    def embed_with_workers():
        return load_all()

    assert embed_with_workers() == (24 * 4, [0, 0])


def test_a_run_stopped_before_the_index_is_completed_by_the_next_without_training(prefect_harness, tmp_path,
                                                                                 glyph_root, monkeypatch):
    """Issue 40, promote last: the flow stops between register and index (a fault at retrain.after_register);
    the version the gate promoted is not champion (nothing would serve it). The next scheduled run indexes it from
    its own checkpoint, which completes the promotion before its plan, so it plans against champion v1."""
    from xbn.config import load_params
    from xbn.flows.retrain import retrain
    from xbn.stages.serve import load
    from xbn.tracking import Registry
    from xbn.tracking.history import read_history
    from xbn.utils.faults import FaultInjected

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    overrides = [*TINY, f"data.root={glyph_root}", "tracking.enabled=true"]
    monkeypatch.setenv("XBN_FAULT", "retrain.after_register:raise")
    with pytest.raises(FaultInjected):
        retrain("params.yaml", overrides)
    params = load_params("params.yaml", overrides)
    registry = Registry(params)
    assert registry.by_alias("champion") is None
    assert registry.get(1).tags["registration"] == "awaiting_index"

    monkeypatch.delenv("XBN_FAULT")
    again = retrain("params.yaml", overrides)
    # Unversioned data (no DVC here), so it then fine-tunes v1 rather than skip: the repair came first.
    assert again["plan"]["champion"] == 1 and "fine-tuning champion v1" in again["plan"]["reason"]
    assert registry.get(1).tags["registration"] == "done"
    assert [(e.action, e.from_version, e.to_version) for e in read_history(registry)][0] == ("gate", None, 1)
    assert registry.by_alias("champion") is not None and load(params).index.count > 0  # the champion serves
