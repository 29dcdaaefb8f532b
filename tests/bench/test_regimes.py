"""A regime's derived rows (issue 18, item 5): the refiner's plain/refined pair and the MPN at test time come from
one training per seed, so the grid schedules only the source job and splits its result into paired runs."""

from __future__ import annotations

from benchmarks.grid import aggregate, with_variants
from benchmarks.regimes import REGIMES


def test_a_derived_row_schedules_its_source_job_once():
    refine, mpn = REGIMES["refine"], REGIMES["mpn"]
    assert refine.scheduled(["plain", "refined"]) == ["refined"]
    assert refine.scheduled(["plain"]) == ["refined"]  # asking for the baseline alone still trains once
    assert mpn.scheduled(["no_mpn", "mpn", "mpn_test_time", "softmax"]) == ["no_mpn", "mpn", "softmax"]
    assert REGIMES["roth"].scheduled(["margin", "rho"]) == ["margin", "rho"]


def test_the_baselines_come_first_and_the_mpn_runs_at_its_paper_batch():
    assert list(REGIMES["refine"].methods)[0] == "plain" and list(REGIMES["mpn"].methods)[0] == "no_mpn"
    assert REGIMES["mpn"].batches == [54]  # CUB's 6 classes x 9 images, which glyphs and Omniglot take
    for method in ("no_mpn", "mpn", "softmax"):
        assert "train.samples_per_class=9" in REGIMES["mpn"].methods[method]
        assert "memory.method=none" in REGIMES["mpn"].methods[method]


def test_a_run_with_variants_becomes_paired_runs_of_its_own():
    run = {"dataset": "glyphs", "method": "refined", "batch": 64, "seed": 2, "recall@1": 0.30, "map@r": 0.12,
           "val_recall@1": 0.55, "train_s": 80.0, "git_commit": "abc", "refine_epoch": 3,
           "variants": {"plain": {"recall@1": 0.25, "map@r": 0.10, "val_recall@1": 0.50}}}
    refined, plain = with_variants(run, REGIMES["refine"].derived)
    assert "variants" not in refined and refined["recall@1"] == 0.30
    assert plain == {"dataset": "glyphs", "batch": 64, "seed": 2, "git_commit": "abc", "train_s": 80.0,
                     "recall@1": 0.25, "map@r": 0.10, "val_recall@1": 0.50, "method": "plain",
                     "derived_from": "refined"}
    table = {r["method"]: r for r in aggregate([refined, plain], ["plain", "refined"])}
    assert table["plain"]["recall@1"] == 0.25 and table["refined"]["recall@1"] == 0.30


def test_a_derived_row_without_a_validation_number_has_none():
    run = {"dataset": "omniglot", "method": "mpn", "batch": 54, "seed": 0, "recall@1": 0.5, "map@r": 0.2,
           "val_recall@1": 0.7, "train_s": 10.0, "variants": {"mpn_test_time": {"recall@1": 0.52, "map@r": 0.21}}}
    rows = aggregate(with_variants(run, REGIMES["mpn"].derived), ["mpn", "mpn_test_time"])
    assert "val_recall@1" in rows[0] and "val_recall@1" not in rows[1]  # never the MPN model's plain val R@1


def test_a_row_derived_from_another_method_is_not_copied_from_each_job():
    run = {"dataset": "glyphs", "method": "refined_light", "batch": 64, "seed": 0, "recall@1": 0.3,
           "variants": {"plain": {"recall@1": 0.25}}}
    assert with_variants(run, REGIMES["refine"].derived) == [{k: v for k, v in run.items() if k != "variants"}]
