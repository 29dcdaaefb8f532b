"""Runs: one run per pipeline execution that the stages join, what log_training / log_evaluation put in it,
and the pyfunc model."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from xbn.tracking import (
    PARENT_RUN_ENV,
    RUN_ID_FILE,
    epoch_logger,
    log_evaluation,
    log_model,
    log_training,
    pipeline_run,
    retrieval_grid,
)
from xbn.utils.io import write_csv

from .helpers import write_eval, write_model


def write_training_outputs(params) -> None:
    """What the train stage leaves behind, in the trainer's own CSV format."""
    metrics = Path(params.train.metrics_dir)
    epochs = [{"epoch": 0, "loss": float("nan"), "val_recall@1": 0.1, "val_map@r": 0.05}]
    epochs += [{"epoch": e, "loss": 1.0 / e, "val_recall@1": 0.1 * e + 0.1, "val_map@r": 0.05 * e}
               for e in (1, 2)]
    steps = [{"iteration": i, "epoch": 1 + i // 3, "loss": 1.0 / i, "lr": 1e-3, "gain": 0.5 / i,
              "memory_std": 0.1, "batch_std": 0.12} for i in range(1, 6)]
    steps = [{**row, "drift_mean": 0.01 * i, "drift_max": 0.02 * i} if i > 1 else row
             for i, row in enumerate(steps, start=1)]
    write_csv(metrics / "train_epochs.csv", epochs)
    write_csv(metrics / "train_steps.csv", steps)
    (metrics / "train.json").write_text(json.dumps({"method": "axbn", "epochs": 2, "best_val_recall@1": 0.3}))
    Path("params.yaml").write_text("memory:\n  method: axbn\n")
    Path(params.validate.report).parent.mkdir(parents=True, exist_ok=True)
    Path(params.validate.report).write_text('{"success": true}')


def test_a_pipeline_run_logs_params_metrics_and_artifacts(params):
    write_model(params, seed=0)
    write_training_outputs(params)
    write_eval(params)
    image = Path("img.png")
    Image.new("RGB", (8, 8), "gray").save(image)
    retrieval_grid([image], ["a"], [[image, image]], [["a", "b"]], "plots/retrieval_grid.png")
    folder = Path(params.eval.output).parent  # what the evaluate stage writes beside eval.json
    write_csv(folder / "recall_at_k.csv", [{"k": k, "recall": r} for k, r in ((1, 0.5), (2, 0.6), (4, 0.8))])
    write_csv(folder / "spectrum.csv", [{"index": i, "singular_value": 1 / i, "normalized": 0.5 / i}
                                        for i in range(1, 9)])

    with pipeline_run(params, "train", new=True) as run:  # the train stage
        log_epoch = epoch_logger(run)
        log_epoch(1, {"epoch": 1, "loss": 1.0, "val_recall@1": 0.2, "val_map@r": 0.05})
        log_epoch(2, {"epoch": 2, "loss": 0.5, "val_recall@1": 0.3, "val_map@r": 0.10})
        logged = log_training(params, run)
    with pipeline_run(params, "evaluate") as joined:  # the evaluate stage, in another process under DVC
        scores = log_evaluation(params, joined)

    assert joined.run_id == run.run_id and joined.resumed and not run.resumed
    assert RUN_ID_FILE.read_text().strip() == run.run_id
    client = MlflowClient(params.tracking.uri)
    data = client.get_run(run.run_id).data
    assert data.params["memory.method"] == params.memory.method and data.params["model.embedding_dim"] == "8"
    assert data.params["loss_composition"] == params.loss_composition  # issue 45: what the loss is made of
    assert data.tags["data_hash"] == hashlib.md5(Path(params.data.manifest).read_bytes()).hexdigest()
    assert len(data.tags["params_hash"]) == 64 and data.tags["model_sha256"]
    assert scores["recall@1"] == 0.5 and data.metrics["recall_at_1"] == 0.5
    assert not {"epoch", "num_queries"} & set(scores) and data.metrics["eval/num_queries"] == 40
    assert data.metrics["untrained/recall_at_1"] == 0.1 and data.metrics["train/best_val_recall_at_1"] == 0.3
    # Epochs 1-2 came from the callback, epoch 0 (the untrained score) from the CSV; none twice.
    assert sorted(m.step for m in client.get_metric_history(run.run_id, "val_recall_at_1")) == [0, 1, 2]
    assert [m.step for m in client.get_metric_history(run.run_id, "step/gain")] == [1, 2, 3, 4, 5]
    assert [m.step for m in client.get_metric_history(run.run_id, "step/drift_mean")] == [2, 3, 4, 5]
    folders = ("", "plots", "metrics", "validation")
    artifacts = {f.path for d in folders for f in client.list_artifacts(run.run_id, d)}
    assert {"params.yaml", "params.resolved.yaml", "plots/training_curves.png",
            "plots/memory_diagnostics.png", "plots/retrieval_grid.png", "plots/evaluation.png", "metrics/eval.json",
            "metrics/train.json",
            "validation/validation.json"} <= artifacts
    assert logged["model_uri"].startswith("models:/")
    assert client.get_run(run.run_id).info.status == "FINISHED"


def test_stages_join_the_run_named_by_file_or_environment(params, monkeypatch):
    with pipeline_run(params, "train", new=True) as first:
        pass
    with pipeline_run(params, "evaluate") as joined:
        assert mlflow.active_run().info.run_id == first.run_id
    with pipeline_run(params, "train", new=True) as second:  # a retrain is a new pipeline execution
        pass
    assert joined.run_id == first.run_id != second.run_id
    with pipeline_run(params, "pipeline", new=True) as outer:  # an orchestrator calling stages in-process
        with pipeline_run(params, "train", new=True) as inner:
            pass
        assert mlflow.active_run().info.run_id == outer.run_id == inner.run_id

    monkeypatch.setenv(PARENT_RUN_ENV, first.run_id)  # an orchestrator's run wins over reports/run_id
    with pipeline_run(params, "train", new=True) as owned:
        pass
    assert owned.run_id == first.run_id and RUN_ID_FILE.read_text().strip() == first.run_id

    # MLflow params are immutable: a stage joining with other values flags them instead of failing.
    changed = params.model_copy(update={"eval": params.eval.model_copy(update={"batch_size": 7})})
    with pipeline_run(changed, "evaluate") as run:
        pass
    data = MlflowClient(params.tracking.uri).get_run(run.run_id).data
    assert data.params["eval.batch_size"] == "128" and data.tags["xbn.params_changed"] == "eval.batch_size"

    monkeypatch.setenv(PARENT_RUN_ENV, "0" * 32)
    with pytest.raises(ValueError, match=PARENT_RUN_ENV):
        with pipeline_run(params, "train"):
            pass


def test_a_failing_stage_marks_the_run_failed(params):
    with pytest.raises(RuntimeError), pipeline_run(params, "train", new=True) as run:
        raise RuntimeError("boom")
    assert MlflowClient(params.tracking.uri).get_run(run.run_id).info.status == "FAILED"


def test_logging_the_same_checkpoint_again_logs_nothing(params):
    write_model(params, seed=1)
    with pipeline_run(params, "train", new=True) as run:
        uri = log_model(params, run)
        assert log_model(params, run) == uri
    # What the logged pyfunc does with images: tests/tracking/test_pyfunc.py.


def test_a_second_configure_in_one_process_uses_its_own_store_and_the_users_environment_still_wins(
        params, tmp_path, monkeypatch):
    """mlflow.set_tracking_uri copies the URI into $MLFLOW_TRACKING_URI; `configure` must not leave it there, or the
    next params in the process (a library caller's, the next test's) would be sent to the first one's store."""
    from xbn.tracking import tracking_uri
    from xbn.tracking.runs import configure

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first, second = params.model_copy(deep=True), params.model_copy(deep=True)
    first.tracking.uri, second.tracking.uri = (f"sqlite:///{tmp_path / n}.db" for n in ("first", "second"))
    assert configure(first) == first.tracking.uri and mlflow.get_tracking_uri() == first.tracking.uri
    assert "MLFLOW_TRACKING_URI" not in os.environ
    assert tracking_uri(second) == configure(second) == second.tracking.uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'server'}.db")  # the user's: it wins
    assert configure(first) == configure(second) == f"sqlite:///{tmp_path / 'server'}.db"
    assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path / 'server'}.db"
    mlflow.set_tracking_uri(None)
