"""Stage `refine` on a tiny trained model: off it writes a marker only, on it trains and eval.json gains
`refined`; in dvc.yaml it sits between train and evaluate."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests_support import ROOT, TINY, brute_force_recall_at_1, split_embeddings
from xbn.cli import main
from xbn.stages.evaluate import evaluate
from xbn.stages.prepare import prepare
from xbn.stages.refine import evaluate_refined, refine
from xbn.training import fit

REFINE = ["eval.baseline=false", "refine.enabled=true", "refine.k=3", "refine.epochs=2", "refine.blocks=1", "refine.heads=2",
          "refine.batch_size=16", "refine.serve=refined", "refine.views=2"]


def test_disabled_is_a_marker_then_enabled_refines_and_evaluate_reports_it(tiny_params, glyph_root):
    params = tiny_params("eval.baseline=false")
    prepare(params)
    fit(params, progress=False)

    cli = ["refine", "-q", "--params", str(ROOT / "params.yaml"),
           *(f"--set={o}" for o in [*TINY, f"data.root={glyph_root}"])]
    assert main(cli) == 0  # the default: disabled
    marker = torch.load("models/refiner.pt", weights_only=True)
    assert marker == {"format": "xbn-refiner/1", "enabled": False}
    assert json.loads(Path("metrics/refine.json").read_text()) == {"enabled": False}
    x = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    assert evaluate_refined(tiny_params(*REFINE), x, [0, 1] * 4, None, None, "models/model.pt") is None

    on = tiny_params(*REFINE)
    summary = refine(on)
    assert summary["served"] == "refined" and len(summary["history"]) == 2
    saved = torch.load("models/refiner.pt", weights_only=True)
    assert saved["enabled"] and saved["k"] == 3 and saved["blocks"] == 1
    # The val scores are the saved embedder's (brute force) and the saved refiner's, recomputed.
    scores = json.loads(Path("metrics/refine.json").read_text())
    val_emb, val_labels = split_embeddings(on, "val")
    plain = brute_force_recall_at_1(val_emb, val_labels)
    assert scores["val_plain_recall@1"] == pytest.approx(plain, abs=1e-12)
    refined = evaluate_refined(on, val_emb, val_labels, None, None, "models/model.pt")
    assert scores["val_refined_recall@1"] == pytest.approx(refined["recall@1"], abs=1e-12)
    # The test protocol, plain and refined, for the report (recomputed the same way); the training views.
    test_emb, test_labels = split_embeddings(on, "test")
    assert scores["test_plain_recall@1"] == pytest.approx(brute_force_recall_at_1(test_emb, test_labels), abs=1e-12)
    again = evaluate_refined(on, test_emb, test_labels, None, None, "models/model.pt")
    assert scores["test_refined_recall@1"] == pytest.approx(again["recall@1"], abs=1e-12)
    assert scores["views"] == 2 and 0 <= scores["train_plain_recall@1"] <= 1
    print("refine.json", scores)

    metrics = evaluate(on)
    written = json.loads(Path("metrics/eval.json").read_text())
    assert written["refined"] == metrics["refined"] and written["refined"]["served"] is True
    names = {"recall@1", "recall@2", "recall@4", "map@r", "r_precision", "nmi", "num_queries"}
    assert names <= set(metrics) and names <= set(metrics["refined"])
    assert metrics["refined"]["num_queries"] == metrics["num_queries"]

    # A refiner trained on another model.pt's embeddings is refused rather than scored.
    with pytest.raises(ValueError, match="xbn refine"):
        evaluate_refined(on, x, [0, 1] * 4, None, None, "models/last.pt")

    # Views with the backbone's full augmentation recipe (the default is light: crop and flip): recorded, and
    # trained on the same way.
    full = refine(tiny_params(*REFINE, "refine.views_augment=full"))
    assert full["views_augment"] == "full" and scores["views_augment"] == "light"
    assert json.loads(Path("metrics/refine.json").read_text())["views_augment"] == "full"


def test_dvc_graph_runs_refine_between_train_and_evaluate(tmp_path):
    shutil.copy(ROOT / "dvc.yaml", tmp_path)
    shutil.copy(ROOT / "params.yaml", tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["dvc", "init", "-q", "--no-scm"], cwd=tmp_path, env=env, check=True)
    out = subprocess.run(["dvc", "dag", "--dot"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    edges = {tuple(part.strip().strip('"') for part in line.strip().rstrip(";").split("->"))
             for line in out.stdout.splitlines() if "->" in line}
    for edge in (("train", "refine"), ("refine", "evaluate"), ("refine", "register")):
        assert edge in edges, (edge, out.stdout)
