"""benchmarks/report.py: every number a section prints is one its results JSON holds (or one a named function
of the benchmark derives and adds to it: `eval_bench.derive`), verdicts come from the recorded intervals, dates
and loads from the provenance, and a loader claim measured under load is dropped with the load that dropped it."""

from __future__ import annotations

import copy

import pytest
from benchmarks import eval_bench, report

from bench.support import PROVENANCE, _iqr, _unexplained

MEMORY = {
    "device": "cpu", "gpu": None, "threads": 3,
    "workloads": {"clustered": {"classes": 417, "spread": 0.61, "noise": 0.37, "samples_per_class": 6}},
    "rows": [{
        "workload": "clustered", "memory_size": 8192, "batch": 48, "dim": 96, "steps": 13, "device": "cpu",
        "mined_pairs_first_batch": {"positive_pairs": 123, "negative_pairs": 4567}, "basis": "process CPU time",
        "ms_per_step": {"none": 1.234, "pml": 21.5, "xbm": 22.75, "axbn": 23.125},
        "paired_ratio": {"axbn/xbm": _iqr(1.0171, 1.0052, 1.0333), "pml/xbm": _iqr(0.9457, 0.9311, 0.9623),
                         "none/xbm": _iqr(0.0542, 0.0511, 0.0587), "axbn/pml": _iqr(1.0777, 1.0651, 1.0888),
                         "xbm/pml": _iqr(1.0575, 1.0392, 1.0741), "none/pml": _iqr(0.0573, 0.0544, 0.0613),
                         "axbn/none": _iqr(18.74, 17.91, 19.66), "xbm/none": _iqr(18.44, 17.03, 19.57),
                         "pml/none": _iqr(17.42, 16.08, 18.33)},
    }],
    "targets": [{"workload": "clustered", "memory_size": 8192, "batch": 48, "ratio": "axbn/xbm", "at_most": 1.02,
                 **_iqr(1.0171, 1.0052, 1.0333), "verdict": "inconclusive"},
                {"workload": "clustered", "memory_size": 8192, "batch": 48, "ratio": "xbm/pml", "at_most": 1.02,
                 **_iqr(1.0575, 1.0392, 1.0741), "verdict": "missed"}],
    "provenance": PROVENANCE, "_file": "benchmarks/results/memory_quick.json",
}


def _eval_row(contender, **extra):
    return {"n": 7000, "classes": 1399, "contender": contender, "status": "ok", "peak_rss_gb": 1.317,
            "wall_s": 9.87, "loadavg_1min_before": 2.22, "baseline_rss_gb": 0.911, "knn_s": 3.3,
            "metrics": {"recall@1": 0.7123, "map@r": 0.4111, "r_precision": 0.4567}, "total_s": 3.3, **extra}


EVAL = {
    "settings": {"dim": 96, "images_per_class": "2-8 (mean 5)", "mem_limit_gb": 11.0},
    "gemm_dtypes": {"shape": [768, 96, 768], "threads": 3, "torch_cpu_capability": "AVX2",
                    "float32_gflops": 27.41, "bfloat16_gflops": 3.29},
    "rows": [_eval_row("ours", knn_s=1.1, knn_all_ks_s=1.9, total_s=1.1, search_s=0.83, search_k=7,
                       search_flops=9876543210, search_gflops=11.9, gemm_block=4096, gemm_float32_gflops=26.13,
                       gemm_threads=3, search_fraction_of_gemm=0.4554),
             _eval_row("pml", max_abs_diff_vs_ours=0.0), _eval_row("sklearn", max_abs_diff_vs_ours=0.0)],
    "provenance": PROVENANCE | {"command": "python -m benchmarks eval --quick"},
    "_file": "benchmarks/results/eval_quick.json",
}

LOADER = {
    "settings": {"glyph_classes": 120, "image_size": 64, "num_workers": 2, "batch_size": 32,
                 "backbone": "tf_efficientnet_lite0", "memory": "axbn", "memory_rows": 153, "rounds": 1},
    "rounds": [{"loadavg_before": [8.31, 7.0, 6.0], "loader_images_per_s": 154.2, "model_images_per_s": 3.28}],
    "summary": {"median_loader_images_per_s": 154.2, "median_model_images_per_s": 3.28,
                "median_train_images_per_s": 2.54, "loader_to_model_ratio": 47.01, "per_round_ratios": [47.01],
                "train_to_model_ratio": 0.774, "target": "loader >= 1.5 x model", "target_met": True},
    "provenance": PROVENANCE | {"loadavg_1min_before": 8.31, "loadavg_1min_after": 9.12},
    "_file": "benchmarks/results/loader.json",
}

def test_memory_section_prints_only_json_numbers_and_the_interquartile_ranges():
    text, targets = report.memory_section(copy.deepcopy(MEMORY))
    assert _unexplained(text, MEMORY) == []
    assert "1.0171 [1.0052, 1.0333]" in text and "**inconclusive**" in text and "**missed**" in text
    assert [t["verdict"] for t in targets] == ["inconclusive", "missed"]
    assert "2031-02-03T04:05:06+00:00 to 2031-02-03T04:17:36+00:00" in text
    assert "**dirty tree** (2 files differed" in text and "3.71 before, 4.93 after" in text
    assert "not in this repository's history" in text  # the fake commit


def test_a_memory_file_without_paired_ratios_is_not_rendered():
    old = {"rows": [{"ms_per_step": {"xbm": 4.4}}], "command": "python -m benchmarks memory",
           "machine": {"git_commit": None}, "_file": "benchmarks/results/memory_cpu.json"}
    text, targets = report.memory_section(old)
    assert targets == [] and "Not shown" in text and "no date, load or clean-tree check" in text
    assert _unexplained(text, old) == []


def test_eval_section_numbers_come_from_the_json_or_eval_bench_derive():
    data = copy.deepcopy(EVAL)
    text, targets = report.eval_section(data)
    derived = copy.deepcopy(EVAL)
    eval_bench.derive(derived["rows"])  # the named formula: time ratios to ours
    assert derived["rows"][1]["knn_ratio_vs_ours"] == 3.0  # 3.3 / 1.1
    assert _unexplained(text, derived | {"targets": targets}) == []
    verdicts = {t["what"]: t["verdict"] for t in targets}
    assert verdicts["AccuracyCalculator time / ours (kNN metrics)"] == "met"
    assert verdicts["search GFLOP/s / float32 GEMM GFLOP/s"] == "missed"
    assert "float32 27.41 GFLOP/s, bfloat16 3.29 GFLOP/s. bfloat16 is slower here" in text
    assert "does not list avx512_bf16" in text


def test_eval_targets_hold_their_bounds():
    targets = eval_bench.targets(_derived_rows())
    assert {t["what"]: (t.get("at_least"), t.get("at_most")) for t in targets}[
        "search GFLOP/s / float32 GEMM GFLOP/s"] == (0.85, None)


def _derived_rows():
    rows = copy.deepcopy(EVAL["rows"])
    eval_bench.derive(rows)
    return rows


def test_loader_claim_under_load_is_dropped_with_the_load_that_dropped_it():
    text, targets = report.loader_section(copy.deepcopy(LOADER))
    assert "47.01" not in text and "No claim" in text and "8.31 to 9.12" in text
    assert targets[0]["verdict"] == "not measurable"
    assert _unexplained(text, LOADER) == []


def test_loader_claim_on_an_idle_machine_is_kept():
    idle = copy.deepcopy(LOADER)
    idle["rounds"][0]["loadavg_before"][0] = 0.42
    idle["provenance"] |= {"loadavg_1min_before": 0.31, "loadavg_1min_after": 0.55}
    text, targets = report.loader_section(idle)
    assert "47.01" in text and targets[0]["verdict"] == "met"
    assert _unexplained(text, idle) == []


def test_the_checker_catches_a_typed_number():
    assert _unexplained("a ratio of 1.19 at 64k", MEMORY) == ["1.19"]


@pytest.mark.parametrize("status", [None, "not run: no GPU lent (CUDA not available)"])
def test_gpu_not_run_has_no_typed_numbers(status):
    data = None if status is None else {"status": status, "_file": "benchmarks/results/gpu.json"}
    text = report.gpu_section(data)
    assert "**not run**" in text and _unexplained(text, data or {}) == []
