"""The served model follows the registry: `xbn index` attaches the catalogue index to the registered version,
`xbn search` and the HTTP endpoint serve the champion's index, and a promotion switches what the endpoint serves
(by polling). A real SQLite MLflow store and real tiny models (tests/tracking's helpers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from serving_support import running, wait_for
from tracking.helpers import run_pipeline, write_manifest

from xbn.cli import main
from xbn.config import Params
from xbn.stages.index import index
from xbn.stages.register import promote
from xbn.stages.serve import serving_app
from xbn.tracking import PARENT_RUN_ENV, Registry
from xbn.tracking.registry import INDEX_RECALL_TAG, INDEX_SHA_TAG


@pytest.fixture
def project(tmp_path, monkeypatch) -> Params:
    """tmp_path laid out like the project: a manifest of real images, a fresh store, params.yaml."""
    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID",
                PARENT_RUN_ENV, "XBN_SERVE_TOKEN", "XBN_SERVE_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("USER", "tester")
    write_manifest(tmp_path / "data/manifest.csv", "v1")
    params = Params.model_validate({
        "data": {"root": "data/images", "image_size": 32, "num_workers": 0},
        "model": {"backbone": "test_resnet", "pretrained": "none", "embedding_dim": 8},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        # every manifest row (34 images of 9 classes), paths relative to data.root
        "index": {"source": "data/manifest.csv"},
        "serve": {"poll_interval_s": 0.2},
    })
    Path("params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    return params


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--params", "params.yaml"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_search_and_the_endpoint_serve_the_champions_index_and_follow_a_promotion(project, capsys):
    query = "data/images/v1/c3_0.png"
    code, _, err = cli(capsys, "search", query)
    # One line, no traceback (the lines before it are MLflow creating the empty store).
    assert code == 1 and "Traceback" not in err and err.strip().splitlines()[-1] == (
        "xbn search: xbn-embedder has no version with alias 'champion': register one (`xbn register`, "
        "`xbn registry promote`), or pass --model-version N or --local")

    report = run_pipeline(project, seed=0)  # v1: the first model is promoted, champion once indexed
    assert report["alias"] == "challenger" and report["registration"] == "awaiting_index"
    code, _, err = cli(capsys, "search", query)
    assert code == 1 and "has no version with alias 'champion'" in err  # the champion is never without index
    code, _, err = cli(capsys, "search", query, "--model-version", "1")
    assert code == 1 and "v1 has no catalogue index: run `xbn index`" in err  # registered, not indexed yet

    first = index(project)
    assert first["version"] == 1 and first["count"] == 34 and first["recall@10"] == 1.0 and first["champion"]
    v1 = Registry(project).get(1)
    assert v1.tags[INDEX_RECALL_TAG] == "1.0000" and len(v1.tags[INDEX_SHA_TAG]) == 64
    assert json.loads(Path("metrics/index.json").read_text())["version"] == 1

    code, out, _ = cli(capsys, "search", query, "missing.png", "--json", "--k", "3")
    assert code == 3  # the unreadable image fails the command, after the other has answered
    found, missing = json.loads(out)
    assert missing == {"query": "missing.png", "error": "cannot read image missing.png: no such file"}
    assert [r["rank"] for r in found["results"]] == [1, 2, 3]
    # The query is a catalogue image: it finds itself first, then its class (solid colours, R@1 = 1).
    assert found["results"][0]["path"] == "v1/c3_0.png" and found["results"][0]["score"] == pytest.approx(1)
    assert [r["label"] for r in found["results"][:3]] == ["3", "3", "3"]

    # v2: another model; the gate holds it back (a tie with v1), so it is the challenger; then indexed.
    assert run_pipeline(project, seed=1)["alias"] == "challenger"
    assert index(project)["version"] == 2
    v1_scores = [r["score"] for r in found["results"]]

    with running(serving_app(project, token=None)) as client:  # what `xbn serve` runs
        health = client.get("/health").json()
        assert (health["version"], health["alias"], health["index_size"]) == ("1", "champion", 34)
        with open(query, "rb") as f:
            image = f.read()
        # The page's review: the champion (v1) and the registry's challenger (v2) answer the same query.
        compared = client.post("/compare", files={"image": ("q.png", image)}, data={"k": "3"}).json()
        assert (compared["champion"]["version"], compared["challenger"]["version"]) == ("1", "2")
        assert compared["challenger"]["alias"] == "challenger"
        assert [r["path"] for r in compared["champion"]["results"]] == [r["path"] for r in found["results"]]
        served = client.post("/search", files={"image": ("q.png", image)}, data={"k": "3"}).json()
        assert served["version"] == "1" and [r["path"] for r in served["results"]] == [
            r["path"] for r in found["results"]]  # what `xbn search` printed
        assert [r["score"] for r in served["results"]] == pytest.approx(v1_scores, abs=1e-5)
        before = client.post("/embed", files={"image": ("q.png", image)}).json()["embedding"]

        promote(project, 2, reason="test: the endpoint follows the alias")
        wait_for(lambda: client.get("/health").json()["version"] == "2")
        after = client.post("/search", files={"image": ("q.png", image)}, data={"k": "3"}).json()
        assert after["version"] == "2" and after["alias"] == "champion"
        now = client.post("/embed", files={"image": ("q.png", image)}).json()["embedding"]
        assert max(abs(a - b) for a, b in zip(before, now)) > 0.01  # v2's model embeds it

    code, out, _ = cli(capsys, "search", query, "--json", "--k", "3")
    assert code == 0 and json.loads(out)[0]["results"] == after["results"]  # the CLI follows it too
    code, out, _ = cli(capsys, "search", query, "--model-version", "1", "--json", "--k", "3")
    assert code == 0 and json.loads(out)[0]["results"] == found["results"]  # a named version
    code, _, err = cli(capsys, "search", query, "--model-version", "7")
    assert code == 1 and "xbn-embedder has no version 7" in err
