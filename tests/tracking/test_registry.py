"""The registry stage against a real SQLite store: first model -> champion, the gate on the val split (both
models embedded, paired bootstrap), idempotent re-register, manual promote and rollback, the review table, and
which tags a version carries (the rest is on its logged model and in its model card)."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from xbn.stages.register import promote, register, review, rollback
from xbn.tracking import Registry, log_evaluation, log_model, pipeline_run
from xbn.utils.errors import RegistryError

from .helpers import METRICS, VAL_QUERIES, run_pipeline, write_eval, write_manifest, write_model

# A version's tags: what a reviewer scans across versions in the MLflow UI's versions table, where every tag
# is a line of each version's row. Everything else belongs in the model card or on the logged model
# (`Registry.record`): a tag added here must be worth a line in every row.
FIRST_MODEL_TAGS = {"decision", "decided_by", "data_hash", "data_md5", "params_hash", "dataset", "memory_method", "batch",
                    "registration",
                    "model_sha256", "served_embedding", "decided_at", "reason"}
COMPARED_TAGS = FIRST_MODEL_TAGS | {"val_recall_at_1", "gate_interval"}  # + previous_champion: it replaced


def versions(params) -> dict[int, dict]:
    client = MlflowClient(params.tracking.uri)
    found = client.search_model_versions(f"name = '{params.registry.model_name}'")
    return {int(v.version): client.get_model_version(v.name, v.version) for v in found}


def interval(gate: dict) -> str:
    """The gate's one-line statement of a comparison, as the reason, the tag and the review quote it."""
    return (f"{gate['metric']} on {gate['split']} {gate['difference']:+.4f} [{gate['low']:+.4f}, "
            f"{gate['high']:+.4f}] (95% paired bootstrap, 1000 resamples, {gate['queries']} queries)")


def short(gate: dict) -> str:
    """The same comparison as the `gate_interval` tag states it, for a narrow cell of the versions table."""
    return (f"{gate['difference']:+.4f} [{gate['low']:+.4f}, {gate['high']:+.4f}] "
            f"vs v{gate['champion_version']}")


def alias(params, name: str) -> int | None:
    try:
        client = MlflowClient(params.tracking.uri)
        return int(client.get_model_version_by_alias(params.registry.model_name, name).version)
    except mlflow.exceptions.MlflowException:
        return None


def test_the_first_model_becomes_champion_and_registering_it_again_changes_nothing(params):
    first = run_pipeline(params, seed=0)
    assert first["version"] == 1 and first["decision"] == "promoted" and first["alias"] == "champion"
    assert "first registered model" in first["reason"] and first["champion_version"] == 1
    v1 = versions(params)[1]
    assert set(v1.tags) == FIRST_MODEL_TAGS and first["metrics"] == METRICS
    assert v1.tags["decided_by"] == "gate"
    assert v1.tags["model_sha256"] and v1.tags["data_hash"] and len(v1.tags["params_hash"]) == 64
    assert "| recall@1 * | 0.5000 | - |" in v1.description and "## Key params" in v1.description
    # The registered model is the run's pyfunc and loads by alias.
    assert mlflow.pyfunc.load_model(f"models:/{params.registry.model_name}@champion").predict is not None

    again = register(params)  # `dvc repro --force`: the same models/model.pt
    assert list(versions(params)) == [1]
    assert again["already_registered"] and again["version"] == 1 and again["decision"] == "promoted"
    assert json.loads(Path(params.registry.report).read_text())["version"] == 1


def test_the_gate_promotes_a_better_model_and_rejects_a_worse_one_on_val_not_on_test(params):
    # The blind model's embeddings all tie: the search breaks ties by the lower index, so every query's neighbour
    # is the first image (the second for the first itself), a hit only for that image's class: R@1 = 4 / 32.
    run_pipeline(params, seed=0, blind=True)
    # The test metrics say worse; the val split, which decides, says every query improved.
    better = run_pipeline(params, seed=1, **{"recall@1": 0.10})
    assert better["decision"] == "promoted" and better["alias"] == "champion"
    assert better["previous_champion"] == 1 and better["compared_with"]["version"] == 1
    assert alias(params, "champion") == 2 and alias(params, "challenger") is None
    gate = better["gate"]
    assert (gate["split"], gate["metric"], gate["queries"]) == ("val", "recall@1", VAL_QUERIES)
    assert gate["champion_version"] == 1
    assert gate["difference"] == 0.875 and 0.5 < gate["low"] <= gate["difference"] <= gate["high"] <= 1.0
    assert gate["challenger_metrics"]["recall@1"] == 1.0 and gate["champion_metrics"]["recall@1"] == 0.125
    assert better["reason"].startswith(f"{interval(gate)} over champion v1: the lower bound exceeds +0.0000")

    # Better on test, blind on val: rejected, the interval and the guarded metrics that fell named.
    worse = run_pipeline(params, seed=2, blind=True, **{"recall@1": 0.90})
    assert (worse["decision"], worse["alias"], worse["champion_version"]) == ("rejected", "challenger", 2)
    assert worse["gate"]["high"] < -0.5
    assert worse["reason"].startswith(f"{interval(worse['gate'])} vs champion v2: the challenger is worse")
    assert "map@r on val fell by" in worse["reason"]
    v3 = versions(params)[3]
    assert v3.tags["decision"] == "rejected" and v3.tags["reason"] == worse["reason"]
    assert v3.tags["decided_by"] == "gate" and v3.tags["decided_at"]
    assert v3.tags["gate_interval"] == short(worse["gate"]) and v3.tags["gate_interval"].endswith("vs v2")
    report = json.loads(Path(params.registry.report).read_text())
    assert (report["decision"], report["champion_version"]) == ("rejected", 2)
    assert report["metrics"]["recall@1"] == 0.90  # the test split's, reported
    assert report["gate"] == worse["gate"] and report["gate"]["resamples"] == 1000

    text = review(params)
    print(text)  # shown with `pytest -s`: the table the report quotes
    lines = {line.split("  ")[0]: line for line in text.splitlines()}
    assert "champion v2" in lines[""] and "challenger v3" in lines[""]
    assert "0.1000" in lines["recall@1 *"] and "0.9000 (+0.8000)" in lines["recall@1 *"]
    assert "promoted" in lines["decision"] and "rejected" in lines["decision"]
    assert f"challenger v3 gate: {interval(worse['gate'])} vs champion v2" in text
    assert f"champion v2 gate: {interval(gate)} vs champion v1" in text
    assert "challenger v3 reason: recall@1 on val" in text


def test_register_twice_shows_the_interval_in_report_review_and_model_card(params):
    run_pipeline(params, seed=0)
    second = run_pipeline(params, seed=1)  # another model.pt, as good on val: a tie, within noise
    assert second["version"] == 2 and second["decision"] == "rejected" and alias(params, "champion") == 1
    interval = (f"recall@1 on val +0.0000 [+0.0000, +0.0000] (95% paired bootstrap, 1000 resamples, "
                f"{VAL_QUERIES} queries)")
    assert second["reason"].startswith(f"{interval} vs champion v1: the interval contains 0")
    report = json.loads(Path(params.registry.report).read_text())
    assert report["gate"] == second["gate"]
    assert {k: report["gate"][k] for k in ("split", "metric", "difference", "low", "high", "resamples",
                                           "queries", "confidence", "seed")} == {
        "split": "val", "metric": "recall@1", "difference": 0.0, "low": 0.0, "high": 0.0, "resamples": 1000,
        "queries": VAL_QUERIES, "confidence": 0.95, "seed": 0}
    v2 = versions(params)[2]
    assert v2.tags["gate_interval"] == "+0.0000 [+0.0000, +0.0000] vs v1"
    card = v2.description
    assert "## Promotion gate" in card and f"{interval} vs champion v1" in card
    assert "| recall@1 * | 1.0000 | 1.0000 | +0.0000 |" in card  # on val, both models
    assert "## Test metrics (reporting only)" in card
    # The trained loss (the shipped default: XBM, centred, + the minibatch loss, as the official XBM code), its
    # notes (model_card.loss_notes: tests/tracking/test_model_card_notes.py) and where its evidence is.
    assert "- loss: SupConLoss against the xbm memory + SupConLoss on the minibatch" in card
    assert "- departs from seed 000's XBN" not in card and "(`memory.center_gradient`)" in card
    assert "README, \"Does the memory help?\"" in card
    # The gate's bootstrap distribution is drawn on the challenger's run and linked from its card.
    client = MlflowClient(params.tracking.uri)
    assert "plots/gate_bootstrap.png" in [f.path for f in client.list_artifacts(v2.run_id, "plots")]
    assert "- the gate's bootstrap distribution: " in card and card.count("/plots/gate_bootstrap.png") == 1
    assert "- the gate's bootstrap distribution: not logged" in versions(params)[1].description  # no champion
    text = review(params)
    assert f"challenger v2 gate: {interval} vs champion v1" in text
    assert "metrics above: split test, for reporting only. Promotion is decided on val" in text
    # The first model was promoted without a comparison: no interval on it.
    assert "gate_interval" not in versions(params)[1].tags and "champion v1 gate:" not in text
    # Issue 41: each version says which gate judged it (a run's overrides can change registry.*).
    judged = ("recall@1 on val, lower bound of the 95% interval above +0; guarded recall@10, map@r, r_precision, "
              "nmi within 0.01; 1000 resamples")
    assert f"**Gate settings:** {judged}" in card and f"challenger v2 judged by: {judged}" in text
    assert report["gate_settings"]["confidence"] == 0.95 and Registry(params).get(1).gate_settings is not None


def test_after_the_data_changed_both_models_are_compared_on_the_current_data(params):
    first = run_pipeline(params, seed=0, blind=True)
    write_manifest(Path(params.data.manifest), "v2")
    second = run_pipeline(params, seed=1)
    assert second["decision"] == "promoted" and alias(params, "champion") == 2
    assert second["data_hash"] != first["data_hash"]  # still recorded on every version
    assert second["gate"]["queries"] == VAL_QUERIES and second["gate"]["champion_metrics"]["recall@1"] <= 0.125


def test_without_a_val_split_a_challenger_is_held_but_the_first_model_is_promoted(params):
    write_manifest(Path(params.data.manifest), "v1", val=False)
    first = run_pipeline(params, seed=0, blind=True)
    assert first["decision"] == "promoted" and first["alias"] == "champion"
    held = run_pipeline(params, seed=1)
    assert held["decision"] == "held" and held["alias"] == "challenger" and alias(params, "champion") == 1
    assert "has no 'val' rows" in held["reason"] and "data.val_classes > 0" in held["reason"]
    assert "not promoted automatically" in held["reason"] and held["gate"] is None


def test_promote_and_rollback_round_trip(params):
    run_pipeline(params, seed=0)
    run_pipeline(params, seed=1)  # as good on val: rejected, v2 is the challenger
    promoted = promote(params, 2, "better on the hard classes", user="alice")
    assert promoted["decision"] == "promoted" and promoted["previous_champion"] == 1
    assert alias(params, "champion") == 2
    assert alias(params, "challenger") is None
    v2 = versions(params)[2].tags
    assert (v2["decided_by"], v2["reason"]) == ("alice", "better on the hard classes")
    assert v2["previous_champion"] == "1"

    again = promote(params, 2, "again", user="alice")  # idempotent
    assert again["decision"] == "unchanged"
    assert versions(params)[2].tags["reason"] == "better on the hard classes"

    restored = rollback(params, "latency regression")
    assert restored["version"] == 1 and restored["decision"] == "restored" and alias(params, "champion") == 1
    tags = versions(params)
    assert tags[2].tags["decision"] == "rolled_back" and tags[2].tags["decided_by"] == "tester"
    assert tags[1].tags["reason"] == "rollback of v2: latency regression"
    with pytest.raises(RegistryError, match="nothing to roll back to: v1 is the first champion"):
        rollback(params, "once more")
    with pytest.raises(ValueError, match="reason"):
        promote(params, 2, " ")
    # Issue 40: MLflow refused a 100,001-character reason after the alias had moved; now nothing is written.
    before = versions(params)
    with pytest.raises(RegistryError, match="over the limit of 5,000"):
        promote(params, 2, "x" * 100_001)
    with pytest.raises(RegistryError, match="--user"):
        rollback(params, "fine", user="u" * 300)
    assert alias(params, "champion") == 1 and versions(params)[2].tags == before[2].tags
    with pytest.raises(ValueError, match="no version 9"):
        promote(params, 9, "missing")


def test_a_version_carries_only_the_tags_a_reviewer_scans_and_the_rest_reads_back_exactly(params):
    run_pipeline(params, seed=0, blind=True)  # the first model: promoted without a comparison
    better = run_pipeline(params, seed=1, **{"recall@1": 0.1 + 0.2, "map@r": 1 / 3})  # promoted over v1
    worse = run_pipeline(params, seed=2, blind=True)  # rejected against v2
    found = versions(params)
    assert set(found[1].tags) == FIRST_MODEL_TAGS
    assert set(found[2].tags) == COMPARED_TAGS | {"previous_champion"}
    assert set(found[3].tags) == COMPARED_TAGS
    assert found[2].tags["val_recall_at_1"] == "1.0000"  # the challenger's R@1 on val, as the gate measured
    assert found[3].tags["val_recall_at_1"] == f"{worse['gate']['challenger_metrics']['recall@1']:.4f}"

    # The test metrics and the gate's comparison are on the version's logged model, at full precision.
    v2 = Registry(params).get(2)
    assert v2.metrics == {**METRICS, "recall@1": 0.1 + 0.2, "map@r": 1 / 3}
    assert v2.gate == better["gate"] and v2.gate["champion_version"] == 1
    assert Registry(params).get(1).gate is None
    client = MlflowClient(params.tracking.uri)
    model = client.get_logged_model(v2.source.removeprefix("models:/"))
    recorded = {m.key: (m.value, m.dataset_name, m.dataset_digest) for m in model.metrics if m.dataset_name}
    assert recorded["recall_at_1"] == (0.1 + 0.2, "test", found[2].tags["data_hash"])
    assert json.loads(model.tags["gate"]) == better["gate"]
    assert client.get_run(v2.run_id).data.metrics["map_at_r"] == 1 / 3  # and on the run, under the usual key
    # In the model card, beside the champion's, and in the report of a later promotion that compares with it.
    assert "| recall@1 * | 0.3000 | 0.5000 | -0.2000 |" in found[2].description
    assert "| map@r + | 0.3333 |" in found[2].description
    promoted = promote(params, 3, "by hand", user="alice")
    assert promoted["compared_with"] == {"version": 2, "metrics": v2.metrics}
    assert promoted["gate"] == worse["gate"] and promoted["metrics"]["recall@1"] == METRICS["recall@1"]


def test_served_refined_metrics_are_recorded_without_changing_the_runs_plain_ones(params):
    write_model(params, seed=0)
    plain = write_eval(params)
    results = json.loads(Path(params.eval.output).read_text())
    results["refined"] = {**plain, "recall@1": 0.7, "served": True}
    Path(params.eval.output).write_text(json.dumps(results))
    Path(params.refine.output).parent.mkdir(parents=True, exist_ok=True)
    Path(params.refine.output).write_bytes(b"refiner")
    with pipeline_run(params, "train", new=True) as run:
        log_evaluation(params, run)  # as evaluate does: plain as recall_at_1, refined as refined/recall_at_1
    report = register(params)
    assert report["metrics"] == {**plain, "recall@1": 0.7}
    v1 = versions(params)[1]
    assert v1.tags["served_embedding"] == "refined" and set(v1.tags) == FIRST_MODEL_TAGS
    logged = MlflowClient(params.tracking.uri).get_run(v1.run_id).data.metrics
    assert logged["recall_at_1"] == 0.5 and logged["refined/recall_at_1"] == 0.7


def test_versions_registered_with_metric_tags_are_still_read(params):
    """Before the metrics moved to the logged model, a version carried them as `metric.<key>` tags and the
    gate's comparison as tag `gate`: stores registered that way still review and report."""
    write_model(params, seed=0)
    with pipeline_run(params, "train", new=True) as run:
        uri = log_model(params, run)
    gate = {"split": "val", "metric": "recall@1", "champion_version": 1, "difference": 0.25, "low": 0.125,
            "high": 0.375, "confidence": 0.95, "resamples": 1000, "seed": 0, "queries": 32,
            "challenger_metrics": {"recall@1": 0.75}, "champion_metrics": {"recall@1": 0.5}}
    registry = Registry(params)
    info = registry.create(uri, {"metric.recall_at_1": repr(0.1 + 0.2), "metric.map_at_r": repr(1 / 3),
                                 "gate": json.dumps(gate), "gate_interval": f"{interval(gate)} vs champion v1",
                                 "decision": "promoted"})
    assert info.metrics == {"recall@1": 0.1 + 0.2, "map@r": 1 / 3} and info.gate == gate
    registry.set_alias("champion", info.version)
    text = review(params)
    lines = {line.split("  ")[0]: line for line in text.splitlines()}
    assert "0.3000" in lines["recall@1 *"] and "0.3333" in lines["map@r +"]
    assert f"champion v1 gate: {interval(gate)} vs champion v1" in text


def test_a_version_is_described_by_the_params_its_model_was_trained_with_not_the_register_calls(params):
    """Issue 26: a model trained on a folder without a memory, registered by a `register` that reads the glyph
    params: the version's hash, card and tags are the training's (recorded in model.pt), never re-derived."""
    from xbn.config import flatten
    from xbn.models import build_embedder, save_embedder
    from xbn.training.trainer import params_hash as training_hash

    trained = params.model_copy(update={
        "data": params.data.model_copy(update={"dataset": "folder", "root": "/datasets/my-shapes"}),
        "memory": params.memory.model_copy(update={"method": "none"}),
        "train": params.train.model_copy(update={"batch_size": 32, "samples_per_class": 8, "epochs": 3})})
    embedder, data_config = build_embedder(trained.model)
    save_embedder(Path(params.train.checkpoint_dir) / "model.pt", embedder, trained.model, data_config,
                  {"epoch": 1, "params": trained.model_dump(mode="json"), "params_hash": training_hash(trained)})
    write_eval(params)
    with pipeline_run(params, "train", new=True):
        pass
    register(params)  # params: glyphs, axbn, batch 64 (the params file's)
    v1 = versions(params)[1]
    assert v1.tags["params_hash"] == training_hash(trained) != training_hash(params)
    assert (v1.tags["dataset"], v1.tags["memory_method"], v1.tags["batch"]) == ("folder:my-shapes", "none",
                                                                                 "32 (4x8)")
    card = v1.description
    assert "folder at `/datasets/my-shapes`" in card and "glyphs" not in card
    assert "- `memory.method`: none" in card and "- `train.batch_size`: 32" in card
    assert "- `train.epochs`: 3" in card and flatten(params)["train.epochs"] != 3
    table = review(params)
    assert "folder:my-shapes" in table and "32 (4x8)" in table
