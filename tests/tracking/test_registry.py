"""The registry stage against a real SQLite store: first model -> champion, the gate, idempotent re-register,
manual promote and rollback, the review table."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from xbn.stages.register import promote, register, review, rollback

from .helpers import run_pipeline, write_manifest


def versions(params) -> dict[int, dict]:
    client = MlflowClient(params.tracking.uri)
    found = client.search_model_versions(f"name = '{params.registry.model_name}'")
    return {int(v.version): client.get_model_version(v.name, v.version) for v in found}


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
    assert v1.tags["metric.recall_at_1"] == "0.5" and "metric.num_queries" not in v1.tags
    assert v1.tags["decided_by"] == "gate"
    assert v1.tags["model_sha256"] and v1.tags["data_hash"] and len(v1.tags["params_hash"]) == 64
    assert "| recall@1 * | 0.5000 | - |" in v1.description and "## Key params" in v1.description
    # The registered model is the run's pyfunc and loads by alias.
    assert mlflow.pyfunc.load_model(f"models:/{params.registry.model_name}@champion").predict is not None

    again = register(params)  # `dvc repro --force`: the same models/model.pt
    assert list(versions(params)) == [1]
    assert again["already_registered"] and again["version"] == 1 and again["decision"] == "promoted"
    assert json.loads(Path(params.registry.report).read_text())["version"] == 1


def test_the_gate_promotes_a_better_model_and_rejects_a_worse_one(params):
    run_pipeline(params, seed=0)
    better = run_pipeline(params, seed=1, **{"recall@1": 0.55})
    assert better["decision"] == "promoted" and better["alias"] == "champion"
    assert better["previous_champion"] == 1 and better["compared_with"]["version"] == 1
    assert alias(params, "champion") == 2 and alias(params, "challenger") is None

    worse = run_pipeline(params, seed=2, **{"recall@1": 0.53, "map@r": 0.25})
    assert (worse["decision"], worse["alias"], worse["champion_version"]) == ("rejected", "challenger", 2)
    assert "recall@1 0.5300 vs champion v2 0.5500" in worse["reason"]
    assert "map@r fell by 0.0500" in worse["reason"]
    v3 = versions(params)[3]
    assert v3.tags["decision"] == "rejected" and v3.tags["reason"] == worse["reason"]
    assert v3.tags["decided_by"] == "gate" and v3.tags["decided_at"]
    report = json.loads(Path(params.registry.report).read_text())
    assert (report["decision"], report["champion_version"]) == ("rejected", 2)
    assert report["metrics"]["map@r"] == 0.25

    text = review(params)
    print(text)  # shown with `pytest -s`: the table the report quotes
    lines = {line.split("  ")[0]: line for line in text.splitlines()}
    assert "champion v2" in lines[""] and "challenger v3" in lines[""]
    assert "0.5500" in lines["recall@1 *"] and "0.5300 (-0.0200)" in lines["recall@1 *"]
    assert "promoted" in lines["decision"] and "rejected" in lines["decision"]
    assert "challenger v3 reason: recall@1" in text


def test_a_model_evaluated_on_other_data_is_held_for_review(params):
    run_pipeline(params, seed=0)
    write_manifest(Path(params.data.manifest), "v2")
    held = run_pipeline(params, seed=1, **{"recall@1": 0.9})
    assert held["decision"] == "held" and held["alias"] == "challenger" and alias(params, "champion") == 1
    assert "other data" in held["reason"] and "not promoted automatically" in held["reason"]


def test_promote_and_rollback_round_trip(params):
    run_pipeline(params, seed=0)
    run_pipeline(params, seed=1, **{"recall@1": 0.40})  # rejected: v2 is the challenger
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
    with pytest.raises(ValueError, match="no previous champion"):
        rollback(params, "once more")
    with pytest.raises(ValueError, match="reason"):
        promote(params, 2, " ")
    with pytest.raises(ValueError, match="no version 9"):
        promote(params, 9, "missing")
