"""Issue 30's section (the memory at a user's scale, batch 16 to 64): generated from the runs, each memory
method judged against `none` per batch by its paired 95% interval, and the batch at which `none` catches up
with axbn at batch 16 computed from the table's means."""

from __future__ import annotations

import statistics

from benchmarks import report
from benchmarks.grid import aggregate, scale_of

from bench.support import PROVENANCE, _unexplained

R1 = {("none", 16): [0.70, 0.72, 0.71], ("axbn", 16): [0.74, 0.75, 0.745],
      ("none", 32): [0.73, 0.735, 0.725], ("axbn", 32): [0.75, 0.74, 0.76],
      ("none", 64): [0.75, 0.745, 0.755], ("axbn", 64): [0.76, 0.75, 0.755]}


def _data(r1):
    runs = [{"dataset": "omniglot64", "method": m, "batch": b, "seed": s, "recall@1": v, "map@r": v / 2,
             "val_recall@1": v + 0.1, "train_s": 200.0, "loadavg_before": 0.4, "loadavg_after": 1.1,
             "git_commit": PROVENANCE["git_commit"]} for (m, b), values in r1.items() for s, v in enumerate(values)]
    return {"_file": "benchmarks/results/grid_scale.json", "command": "python -m benchmarks grid --datasets "
            "omniglot64", "provenance": PROVENANCE, "machine": {"git_commit": PROVENANCE["git_commit"]},
            "settings": {"workers": 2, "threads": 1, "scale": scale_of("glyphs"),
                         "scales": {"omniglot64": scale_of("omniglot64")}},
            "data": {"omniglot64": {"spec": {"image_size": 64}, "splits": {
                "train": {"classes": 306, "images": 6120}, "val": {"classes": 54, "images": 1080},
                "test": {"classes": 264, "images": 5280}}}},
            "runs": runs, "table": aggregate(runs)}


def test_the_scale_section_judges_each_batch_and_says_where_none_catches_up():
    data = _data(R1)
    text = report.grid_section(data, "## 6b. Where the memory matters")
    assert "1 warm-up + 4 epochs, lr step every 4" in text
    axbn16 = statistics.mean(R1["axbn", 16])
    assert f"- `none` first reaches axbn's test R@1 at batch 16 ({axbn16:.4f}) at batch 64 (0.7500" in text
    d16 = report.paired_difference(data["runs"], "omniglot64", 16, "axbn", "none")
    assert d16["low"] > 0 and "Better than `none` beyond the seed spread" in text
    derived = [v for b in (16, 32, 64) if (d := report.paired_difference(data["runs"], "omniglot64", b, "axbn",
                                                                          "none")) for v in d.values()]
    assert _unexplained(text, {**data, "derived": [*derived, len(data["runs"])], "confidence": 95}) == []


def test_none_that_never_catches_up_is_said_with_its_best():
    r1 = {**R1, ("none", 64): [0.70, 0.71, 0.72]}
    text = report.batch_to_match(_data(r1), "omniglot64")
    assert text.startswith("- `none` does not reach axbn's test R@1 at batch 16") and "batch 64 it has 0.7100" in text
    assert report.batch_to_match(_data({("none", 16): [0.7, 0.7]}), "omniglot64") is None  # no axbn at 16


def test_none_ahead_at_the_small_batch_and_a_memory_that_loses_are_said_as_such():
    # glyphs64 as measured: none beats axbn at batch 16 already, and every memory loses beyond the spread
    r1 = {("none", 16): [0.59, 0.60, 0.58], ("axbn", 16): [0.54, 0.55, 0.535],
          ("none", 64): [0.64, 0.63, 0.635], ("axbn", 64): [0.60, 0.61, 0.605]}
    data = _data(r1)
    assert report.batch_to_match(data, "omniglot64") == ("- `none` already beats axbn at batch 16 (0.5900 "
                                                         "against 0.5417; means over seeds).")
    verdict = report.batch_verdict(data, "omniglot64")
    assert "batch 16: best memory method axbn" in verdict and "(a loss beyond the seed spread)" in verdict
    assert "gain" not in verdict


def test_the_shipped_default_is_a_memory_with_the_batch_loss_only_where_it_is_not_worse_than_none():
    # Issue 45's rule, at the shipped batch: the paired interval not below 0 on every set; of those that clear
    # it, validation decides, a tie keeping axbn.
    base = {("none", 64): [0.75, 0.745, 0.755], ("axbn*", 64): [0.76, 0.75, 0.765],
            ("xbn*", 64): [0.761, 0.749, 0.766]}  # axbn* clears 0; xbn*'s interval dips just below
    lines = report.batch_loss_decision(_data(base), 64)
    assert lines[0].startswith("- xbn* at batch 64") and "Interval not below 0 on every set: no" in lines[0]
    assert lines[-1].startswith("- **Shipped default by issue 45's rule: axbn*** (interval not below 0 at batch 64")
    both = {**base, ("xbn*", 64): [0.762, 0.751, 0.764]}
    assert "a tie on validation keeps the shipped method" in report.batch_loss_decision(_data(both), 64)[-1]
    losing = {**base, ("axbn*", 64): [0.70, 0.69, 0.71], ("xbn*", 64): [0.70, 0.695, 0.705]}
    lines = report.batch_loss_decision(_data(losing), 64)
    assert lines[-1].startswith("- **Shipped default by issue 45's rule: none**")
    assert all("not worse beyond the spread on every set: no" in line for line in lines[:-1])
    assert report.batch_loss_decision(_data({("none", 64): [0.7, 0.71]}), 64) == []  # no candidate measured


def test_runs_on_another_cpu_are_named_and_never_paired_with_these():
    data = _data(R1)
    for r in data["runs"]:
        r["cpu"] = "Intel(R) Xeon(R) Processor" if r["batch"] == 64 else "AMD EPYC"
    text = report.grid_section(data, "## 6c")
    assert "Runs on more than one CPU" in text and "AMD EPYC: omniglot64 batch 16, omniglot64 batch 32" in text
    for r in data["runs"]:  # axbn's batch-16 runs moved to the other CPU: nothing left to pair them with
        if (r["method"], r["batch"]) == ("axbn", 16):
            r["cpu"] = "Intel(R) Xeon(R) Processor"
    assert report.paired_difference(data["runs"], "omniglot64", 16, "axbn", "none") is None
    assert report.paired_difference(data["runs"], "omniglot64", 32, "axbn", "none") is not None
