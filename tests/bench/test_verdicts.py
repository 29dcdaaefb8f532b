"""benchmarks/verdicts.py: a target is met only when the whole interval is on its side, missed only when none
of it is; interval() is the median and interquartile range (numpy's linear interpolation)."""

from __future__ import annotations

import numpy as np
import pytest
from benchmarks.verdicts import INCONCLUSIVE, MET, MISSED, interval, median_interval, verdict


@pytest.mark.parametrize(("low", "high", "expected"), [
    (0.99, 1.02, MET),           # all of it at or below 1.02 (the bound itself counts as met)
    (1.021, 1.05, MISSED),       # all of it above
    (1.01, 1.03, INCONCLUSIVE),  # straddles: a median of 1.015 alone would have said met
])
def test_at_most(low, high, expected):
    assert verdict(low, high, at_most=1.02) == expected


@pytest.mark.parametrize(("low", "high", "expected"), [
    (3.0, 3.4, MET), (2.1, 2.9, MISSED), (2.8, 3.1, INCONCLUSIVE)])
def test_at_least(low, high, expected):
    assert verdict(low, high, at_least=3.0) == expected


def test_a_single_value_is_met_or_missed():
    assert verdict(0.85, 0.85, at_least=0.85) == MET and verdict(0.63, 0.63, at_least=0.85) == MISSED


def test_bad_calls_fail_with_reasons():
    with pytest.raises(ValueError, match="exactly one"):
        verdict(1, 2)
    with pytest.raises(ValueError, match="exactly one"):
        verdict(1, 2, at_most=1, at_least=0)
    with pytest.raises(ValueError, match="low > high"):
        verdict(2, 1, at_most=3)
    with pytest.raises(ValueError, match="at least one"):
        interval([])


def test_interval_by_hand():
    # sorted 1, 2, 4, 8, 10: median 4; p25 at position 1 -> 2; p75 at position 3 -> 8
    assert interval([8, 1, 4, 10, 2]) == {"median": 4.0, "p25": 2.0, "p75": 8.0, "n": 5}
    # four values: p25 at position 0.75 -> 1 + 0.75 * (2 - 1) = 1.75; p75 at 2.25 -> 3 + 0.25 = 3.25
    assert interval([1, 2, 3, 4]) == {"median": 2.5, "p25": 1.75, "p75": 3.25, "n": 4}


def test_the_medians_interval_narrows_with_more_steps_where_the_iqr_does_not():
    rng = np.random.default_rng(1)
    few, many = (1.01 + 0.1 * rng.standard_normal(n) for n in (30, 3000))
    narrow, wide = median_interval(many), median_interval(few)
    assert narrow["low"] <= narrow["median"] <= narrow["high"] and narrow["n"] == 3000
    assert narrow["high"] - narrow["low"] < (wide["high"] - wide["low"]) / 5
    assert narrow["low"] < 1.01 < narrow["high"] and narrow["high"] < 1.02  # met, while the IQR spans 0.94-1.08
    iqr = interval(many)
    assert iqr["p25"] < 0.95 and iqr["p75"] > 1.07
    assert median_interval(few) == wide  # a fixed seed: the same file renders the same verdict
    assert median_interval([2.0]) == {"median": 2.0, "low": 2.0, "high": 2.0, "n": 1, "level": 0.95}
