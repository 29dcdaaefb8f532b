"""Section 15's targets are judged on the newest grid of each dataset (`grid_fix.json`, `grid_fix_omniglot.json`), in
its arm names (`oracle_c`, `xbn_c`, `xbm_c`), from the paired differences of its runs; an older grid of the same
dataset is shown but decides nothing."""

from __future__ import annotations

from benchmarks import collapse_study, report

from bench.support import PROVENANCE


def _grid(name, arms, dataset="sop_like"):
    """`arms`: {method: test R@1 per seed} at batch 16, or {(method, batch): ...}."""
    runs = [{"dataset": dataset, "method": m[0] if isinstance(m, tuple) else m,
             "batch": m[1] if isinstance(m, tuple) else 16, "seed": s, "recall@1": v, "best_epoch": 2 + s,
             "git_commit": PROVENANCE["git_commit"]} for m, values in arms.items() for s, v in enumerate(values)]
    return {"_file": f"benchmarks/results/{name}.json", "command": f"python -m benchmarks grid --output {name}",
            "provenance": PROVENANCE | {"command": "grid"}, "machine": {"git_commit": PROVENANCE["git_commit"]},
            "settings": {"scales": {dataset: {"warmup_epochs": 1, "epochs": 4}}}, "runs": runs}


def test_the_newest_grid_decides_in_its_own_arm_names():
    old = _grid("grid_collapse", {"none": [0.50, 0.49, 0.51], "oracle": [0.20, 0.21, 0.22]})
    new = _grid("grid_fix", {"none": [0.50, 0.49, 0.51], "oracle_c": [0.50, 0.495, 0.505],
                             "xbn_c": [0.45, 0.44, 0.46], "xbm_c": [0.40, 0.41, 0.42]})
    text, found = collapse_study.render([], [old, new], report._header, report.paired_difference)
    assert "grid_collapse.json" in text and "grid_fix.json" in text
    assert {t["file"] for t in found} == {"benchmarks/results/grid_fix.json"}
    oracle = next(t for t in found if "oracle" in t["what"])
    assert oracle["verdict"] == "met" and oracle["value"].startswith("+0.000")
    ordering = next(t for t in found if "XBN - XBM" in t["what"])
    assert ordering["verdict"] == "met" and ordering["value"].startswith("+0.040")


def test_each_dataset_keeps_its_newest_grid_and_the_promise_pairs_batch_16_with_none_at_64():
    sop = _grid("grid_fix", {"none": [0.50, 0.49, 0.51], "xbn_c": [0.45, 0.44, 0.46], "xbm_c": [0.40, 0.41, 0.42]})
    omniglot = _grid("grid_fix_omniglot", {
        ("none", 16): [0.70, 0.71, 0.72], ("xbn*", 16): [0.75, 0.76, 0.77], ("xbm_c", 16): [0.50, 0.52, 0.51],
        ("none", 64): [0.74, 0.74, 0.76], ("xbn*", 64): [0.76, 0.75, 0.77]}, dataset="omniglot64")
    text, found = collapse_study.render([], [sop, omniglot], report._header, report.paired_difference)
    assert {t["file"] for t in found} == {sop["_file"], omniglot["_file"]}  # one grid per dataset decides
    promise = next(t for t in found if t["file"] == omniglot["_file"] and "batch 64" in t["what"])
    # xbn* is the best memory at batch 16 (0.76 on the mean); against none at batch 64: +0.01, +0.02, +0.01
    assert "(xbn*)" in promise["what"] and promise["value"].startswith("+0.013") and promise["verdict"] == "met"
    assert "`none` at batch 64, paired by seed: +0.013" in text


def test_fewer_than_three_paired_seeds_are_shown_and_judged_inconclusive():
    grid = _grid("grid_fix", {"none": [0.50, 0.49], "oracle_c": [0.60, 0.61], "xbn_c": [0.70, 0.71],
                              "xbm_c": [0.40, 0.41]})
    _, found = collapse_study.render([], [grid], report._header, report.paired_difference)
    judged = [t for t in found if "warm-up" not in t["what"]]
    assert judged and {t["verdict"] for t in judged} == {"inconclusive"}


def test_an_ordering_with_an_arm_that_did_not_train_is_not_evidence():
    grid = _grid("grid_fix", {"none": [0.50, 0.49, 0.51], "xbn_c": [0.70, 0.71, 0.72], "xbm_c": [0.40, 0.41, 0.42]})
    for run in grid["runs"]:
        if run["method"] == "xbm_c" and run["seed"] == 1:
            run["best_epoch"] = 1  # the warm-up's checkpoint: the arm never improved on it
    text, found = collapse_study.render([], [grid], report._header, report.paired_difference)
    ordering = next(t for t in found if "XBN - XBM" in t["what"])
    assert ordering["verdict"] == "inconclusive" and "xbm_c s1 did not train" in ordering["value"]
    assert "Not evidence yet: xbm_c s1 never beat the warm-up's checkpoint." in text
