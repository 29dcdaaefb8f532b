"""The training-time benchmark's verdict and report text (issue 28: make run's training, new / old <= 0.6)."""

from benchmarks import train_time


def result(new: list[float], old: list[float]) -> dict:
    """A results file as main writes it, with a stored ratio and verdict that are deliberately wrong: render must
    judge the measured times, not repeat what the file claims."""
    return {"overrides": ["tracking.enabled=false"], "rounds": len(new), "new_commit": "a" * 40,
            "old_commit": "b" * 40, "train_s": {"new": new, "old": old}, "loadavg_1min_per_run": [0.5, 0.6],
            "runs": {"new": [{"best_val_recall@1": 0.71, "channels_last": True}],
                     "old": [{"best_val_recall@1": 0.7}]}, "new_over_old": 9.99,
            "target_at_most": train_time.TARGET, "verdict": "tampered"}


def test_render_states_both_times_the_ratio_and_the_verdict():
    text, rows = train_time.render(result([60.0], [120.0]))
    assert "took [60.0] s" in text and "took [120.0] s" in text and "**0.5**" in text
    assert "new 0.71, old 0.7" in text
    assert rows == [{"section": "train_time", "what": "make run's training wall time, new / old commit <= 0.6",
                     "value": 0.5, "verdict": "met"}]
    assert train_time.render(result([90.0], [120.0]))[1][0]["verdict"] == "missed"
    # the median of each side: 3 rounds, one outlier each
    assert train_time.render(result([50.0, 70.0, 500.0], [120.0, 1.0, 118.0]))[1][0] == {
        "section": "train_time", "what": "make run's training wall time, new / old commit <= 0.6",
        "value": round(70 / 118, 3), "verdict": "met"}
