"""Verdicts computed from intervals, never typed: a target is met only when the whole interval is on its side.

A median alone says nothing about whether a 2% target is met when step times spread by 3%: the interval does.
`interval` summarises paired per-step ratios as median and interquartile range; `verdict` reads an interval
against a bound.

The interquartile range says how single steps vary, not how well the median ratio is known: with steps spread by
10%, no method 1% slower than another could ever have its whole IQR under a 2% bound. Where a target is about
the typical ratio (the memory's step, issue 44), `median_interval` gives the median's 95% bootstrap interval,
which narrows with the number of steps measured.
"""

from __future__ import annotations

import numpy as np

MET, MISSED, INCONCLUSIVE = "met", "missed", "inconclusive"


def interval(values) -> dict[str, float]:
    """Median and interquartile range (p25, p75; numpy's linear interpolation) of `values`, and their count."""
    values = np.asarray(list(values), dtype=np.float64)
    if values.size == 0:
        raise ValueError("an interval needs at least one value")
    p25, median, p75 = np.percentile(values, [25, 50, 75])
    return {"median": round(float(median), 4), "p25": round(float(p25), 4), "p75": round(float(p75), 4),
            "n": int(values.size)}


def median_interval(values, level: float = 0.95, resamples: int = 4000, seed: int = 0) -> dict[str, float]:
    """The median of `values` and its percentile-bootstrap interval at `level` (`low`, `high`), and the count.
    Deterministic (a fixed seed), so a results file renders the same verdict every time."""
    values = np.asarray(list(values), dtype=np.float64)
    if values.size == 0:
        raise ValueError("an interval needs at least one value")
    draws = np.random.default_rng(seed).integers(0, values.size, size=(resamples, values.size))
    medians = np.median(values[draws], axis=1)
    tail = 50 * (1 - level)
    low, high = np.percentile(medians, [tail, 100 - tail])
    return {"median": round(float(np.median(values)), 4), "low": round(float(low), 4),
            "high": round(float(high), 4), "n": int(values.size), "level": level}


def verdict(low: float, high: float, *, at_most: float | None = None, at_least: float | None = None) -> str:
    """'met' when the whole interval [low, high] satisfies the bound, 'missed' when none of it does, else
    'inconclusive'. Exactly one of `at_most` / `at_least`."""
    if (at_most is None) == (at_least is None):
        raise ValueError("give exactly one of at_most, at_least")
    if low > high:
        raise ValueError(f"interval [{low}, {high}] is empty: low > high")
    if at_most is not None:
        return MET if high <= at_most else MISSED if low > at_most else INCONCLUSIVE
    return MET if low >= at_least else MISSED if high < at_least else INCONCLUSIVE
