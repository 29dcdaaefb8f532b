"""docs/benchmarks.md's first screen: one row per target, the newest verdict per kind of machine."""

import sys

from tests_support import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks.verdict_summary import machine_kind, summary_table  # noqa: E402


def target(file: str, kind: str, when: str, verdict, value, **extra):
    return {"section": "s", "file": file, "kind": kind, "when": when, "anchor": "a", "verdict": verdict,
            "value": value, **extra}


def test_one_row_per_target_with_the_newest_verdict_of_each_kind():
    rows = [
        target("r/old.json", "AVX2 CPU", "2026-01-01", "missed", 0.5, what="ratio", at_least=0.9),
        target("r/new.json", "AVX2 CPU", "2026-02-01", "met", 0.95, what="ratio", at_least=0.9),
        target("r/gpu.json", "GPU", "2026-01-15", False, 0.1, what="ratio", at_least=0.9),
        target("r/x_quick.json", "AVX512 CPU", "2026-03-01", "met", 1.0, what="ratio", at_least=0.9),
        *(target("r/mem.json", "AVX512 CPU", "2026-01-01", v, 1.0, ratio="xbn/xbm", workload="w", memory_size=m,
                 batch=16, at_most=1.02) for v, m in (("met", 4096), ("inconclusive", 65536))),
    ]
    table = summary_table(rows).splitlines()
    assert table[4:] == ["", "2 live targets."]
    assert table[2].startswith("| ratio, at least 0.9 | **met**: 0.95 | not measured on this kind of machine | "
                               "**missed**: 0.1 |")  # quick run left out
    assert "**1 inconclusive**, **1 met** of 2 configurations" in table[3]


def test_a_retired_target_leaves_the_screen_saying_why():
    rows = [target("r/a.json", "AVX2 CPU", "2026-01-01", "met", 1.0, what="ratio", at_least=0.9),
            target("r/b.json", "AVX2 CPU", "2026-01-01", "missed", 0.9,
                   what="training epoch wall time, decode cache / PIL <= 0.8")]
    table = summary_table(rows)
    assert "1 live targets" in table and "| training epoch" not in table
    assert "- replaced by make run's training wall time (section 11)" in table and "decode cache / PIL" in table


def test_the_kind_comes_from_the_recorded_machine():
    assert machine_kind({"_file": "memory_cuda.json"}) == "GPU"
    assert machine_kind({"runs": [{"gpu": "NVIDIA H200"}]}) == "GPU"
    assert machine_kind({"provenance": {"machine": {"cpu_flags": ["avx2", "avx512f"]}}}) == "AVX512 CPU"
    assert machine_kind({"machine": {"cpu_flags": ["avx2"]}}) == "AVX2 CPU"
