"""Section 9 (a seed method in its paper's regime) is generated from the runs: the table's means and stds, and
each variant's verdict against the regime's baseline from the paired 95% interval (better / worse / within the
seed spread), every number taken from the JSON or the named paired difference."""

from __future__ import annotations

from benchmarks import report

from bench.support import PROVENANCE, _unexplained


def _run(method, seed, r1):
    return {"dataset": "glyphs", "method": method, "batch": 64, "seed": seed, "recall@1": r1, "map@r": r1 / 2,
            "val_recall@1": r1 + 0.2, "train_s": 100.0, "git_commit": PROVENANCE["git_commit"]}


def _table(method, values):
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return {"dataset": "glyphs", "method": method, "batch": 64, "seeds": len(values), "recall@1": mean,
            "recall@1_std": std, "map@r": mean / 2, "map@r_std": std / 2, "val_recall@1": mean + 0.2,
            "val_recall@1_std": std, "train_s": 100.0}


MARGIN, RHO, SPC_R = [0.20, 0.22, 0.21], [0.25, 0.28, 0.26], [0.19, 0.23, 0.20]
DATA = {
    "_file": "benchmarks/results/grid_roth.json",
    "command": "python -m benchmarks grid --regime roth",
    "provenance": PROVENANCE | {"command": "python -m benchmarks grid --regime roth"},
    "machine": {"git_commit": PROVENANCE["git_commit"]},
    "settings": {"regime": {"about": "Roth", "methods": {}}},
    "runs": [_run(m, s, v) for m, values in (("margin", MARGIN), ("rho", RHO), ("spc_r", SPC_R))
             for s, v in enumerate(values)],
    "table": [_table("margin", MARGIN), _table("rho", RHO), _table("spc_r", SPC_R)],
}


def test_variants_are_judged_against_the_baseline_by_their_paired_interval():
    text = report.regime_section(DATA)
    rho = report.paired_difference(DATA["runs"], "glyphs", 64, "rho", "margin")
    spc = report.paired_difference(DATA["runs"], "glyphs", 64, "spc_r", "margin")
    assert rho["low"] > 0 and spc["low"] < 0 < spc["high"]  # by construction of the fake runs
    assert "- rho is **better than** margin: test R@1 difference +0.0533" in text
    assert "- spc_r is **within the seed spread of** margin" in text
    assert "Baseline: **margin**" in text and "| rho | 64 | 3 | 0.2633 ± 0.0153 |" in text
    derived = [rho["mean"], rho["low"], rho["high"], spc["mean"], spc["low"], spc["high"]]
    # Beyond the JSON: the paired differences, the interval's confidence and the regime's own description.
    from benchmarks.regimes import REGIMES

    assert _unexplained(text, {**DATA, "derived": derived, "confidence": 95, "about": REGIMES["roth"].about}) == []


def test_runs_that_kept_the_head_warm_up_are_named():
    runs = [{**r, "best_epoch": 1 if (r["method"], r["seed"]) == ("spc_r", 0) else 7} for r in DATA["runs"]]
    text = report.regime_section({**DATA, "runs": runs, "settings": {**DATA["settings"],
                                                                      "scale": {"warmup_epochs": 1}}})
    assert ("- Kept the head warm-up (selected epoch <= 1: no later epoch beat it on validation R@1): spc_r seed 0 "
            "(test R@1 0.1900, val 0.3900).") in text
    assert "Kept the head warm-up" not in report.regime_section(DATA)  # no best_epoch recorded: nothing said


def test_a_variant_with_one_seed_is_not_judged():
    one = {**DATA, "runs": [r for r in DATA["runs"] if r["method"] != "rho" or r["seed"] == 0]}
    assert "- rho vs margin: 1 seed(s), too few to compare." in report.regime_section(one)
