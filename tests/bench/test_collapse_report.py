"""Section 15's targets are judged on the newest grid (`grid_fix.json`), in its arm names (`oracle_c`, `xbn_c`,
`xbm_c`), from the paired differences of its runs; an older grid is shown but decides nothing."""

from __future__ import annotations

from benchmarks import collapse_study, report

from bench.support import PROVENANCE


def _grid(name, arms):
    runs = [{"dataset": "sop_like", "method": m, "batch": 16, "seed": s, "recall@1": v, "best_epoch": 2 + s,
             "git_commit": PROVENANCE["git_commit"]} for m, values in arms.items() for s, v in enumerate(values)]
    return {"_file": f"benchmarks/results/{name}.json", "command": f"python -m benchmarks grid --output {name}",
            "provenance": PROVENANCE | {"command": "grid"}, "machine": {"git_commit": PROVENANCE["git_commit"]},
            "settings": {"scales": {"sop_like": {"warmup_epochs": 1, "epochs": 4}}}, "runs": runs}


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
