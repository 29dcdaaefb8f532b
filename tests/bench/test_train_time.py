"""The training-time benchmark's verdict and report text (issue 28: make run's training, new / old <= 0.6)."""

from benchmarks import train_time


def result(new: list[float], old: list[float]) -> dict:
    ratio = sorted(new)[len(new) // 2] / sorted(old)[len(old) // 2]
    return {"overrides": ["tracking.enabled=false"], "rounds": len(new), "new_commit": "a" * 40,
            "old_commit": "b" * 40, "train_s": {"new": new, "old": old}, "loadavg_1min_per_run": [0.5, 0.6],
            "runs": {"new": [{"best_val_recall@1": 0.71, "channels_last": True}],
                     "old": [{"best_val_recall@1": 0.7}]}, "new_over_old": round(ratio, 3),
            "target_at_most": train_time.TARGET, "verdict": "met" if ratio <= train_time.TARGET else "missed"}


def test_render_states_both_times_the_ratio_and_the_verdict():
    text, rows = train_time.render(result([60.0], [120.0]))
    assert "took [60.0] s" in text and "took [120.0] s" in text and "**0.5**" in text
    assert "new 0.71, old 0.7" in text
    assert rows == [{"section": "train_time", "what": "make run's training wall time, new / old commit <= 0.6",
                     "value": 0.5, "verdict": "met"}]
    assert train_time.render(result([90.0], [120.0]))[1][0]["verdict"] == "missed"
