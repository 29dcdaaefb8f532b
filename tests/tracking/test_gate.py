"""The promotion gate's decision alone: hand-made per-query scores of a challenger and a champion on the same
queries -> the paired-bootstrap comparison -> promoted / rejected, with the interval in the reason."""

from __future__ import annotations

import numpy as np
import pytest
from tests_support import ROOT

from xbn.config import ConfigError, RegistryConfig, load_params
from xbn.stages.promotion import Comparison, SplitScores, compare, decide

GUARDED = {"recall@10": 0.80, "map@r": 0.30, "r_precision": 0.35, "nmi": 0.60}


def scores(hits, **metrics: float) -> SplitScores:
    """A model on the gate split: R@1 hits per query (queries q0, q1, ...) and its other metrics."""
    hits = np.asarray(hits, dtype=float)
    return SplitScores({"recall@1": float(hits.mean()), **GUARDED, **metrics},
                       [f"q{i}" for i in range(len(hits))], {"recall@1": hits})


def hits(n: int, right: int) -> np.ndarray:
    out = np.zeros(n)
    out[:right] = 1
    return out


def test_identical_hits_are_a_tie_and_a_tie_is_not_promoted():
    same = scores(hits(100, 60))
    decision = decide(compare(same, same, 4, RegistryConfig()), RegistryConfig())
    assert (decision.promote, decision.decision) == (False, "rejected")
    assert decision.reason.startswith(
        "recall@1 on val +0.0000 [+0.0000, +0.0000] (95% paired bootstrap, 1000 resamples, 100 queries) "
        "vs champion v4: the interval contains 0")


def test_a_difference_within_noise_is_rejected_with_its_interval():
    champion = scores(hits(40, 20))
    challenger_hits = hits(40, 20)
    challenger_hits[20] = 1  # right on one more query of 40: +0.025
    comparison = compare(scores(challenger_hits), champion, 4, RegistryConfig())
    assert comparison.difference == pytest.approx(0.025) and comparison.low <= 0 <= comparison.high
    decision = decide(comparison, RegistryConfig())
    assert decision.decision == "rejected" and not decision.promote
    assert comparison.interval() in decision.reason
    assert decision.reason.startswith("recall@1 on val +0.0250 [")
    assert "(95% paired bootstrap, 1000 resamples, 40 queries) vs champion v4" in decision.reason
    assert "the interval contains 0: the difference is within noise" in decision.reason
    assert "lower bound above +0.0000 (registry.min_improvement)" in decision.reason


def test_a_clear_improvement_is_promoted_and_the_minimum_improvement_applies_to_the_lower_bound():
    champion, challenger = scores(hits(100, 50)), scores(hits(100, 80))  # right on 30 more of 100
    comparison = compare(challenger, champion, 4, RegistryConfig())
    assert comparison.difference == pytest.approx(0.30) and comparison.low > 0.15
    decision = decide(comparison, RegistryConfig())
    assert decision.promote and decision.decision == "promoted"
    assert decision.reason.startswith(f"{comparison.interval()} over champion v4: the lower bound exceeds")
    # The same difference against a bar above its lower bound: better, but not by enough.
    strict = RegistryConfig(min_improvement=0.25)
    decision = decide(compare(challenger, champion, 4, strict), strict)
    assert decision.decision == "rejected" and "does not exceed the required improvement" in decision.reason
    # And a clearly worse challenger says so.
    worse = decide(compare(champion, challenger, 4, RegistryConfig()), RegistryConfig())
    assert worse.decision == "rejected" and "the challenger is worse" in worse.reason


def test_guarded_metrics_on_the_gate_split_may_fall_only_within_the_tolerance():
    champion = scores(hits(100, 50))
    cfg = RegistryConfig(tolerance=0.01)
    assert decide(compare(scores(hits(100, 80), nmi=0.59), champion, 4, cfg), cfg).promote
    worse = scores(hits(100, 80), nmi=0.58, r_precision=0.30)
    decision = decide(compare(worse, champion, 4, cfg), cfg)
    assert decision.decision == "rejected"
    assert "nmi on val fell by 0.0200" in decision.reason
    assert "r_precision on val fell by 0.0500" in decision.reason
    assert "the interval" not in decision.reason.split(": ", 1)[1]  # the primary metric itself passed


def test_queries_are_paired_by_name_and_the_resampling_follows_the_seed():
    champion = scores(hits(60, 30))
    shuffled = np.random.default_rng(0).permutation(60)
    # The same model, its queries listed in another order: paired by name, still an exact tie.
    same = SplitScores(champion.metrics, [champion.queries[i] for i in shuffled],
                       {"recall@1": champion.per_query["recall@1"][shuffled]})
    tie = compare(same, champion, 4, RegistryConfig())
    assert (tie.difference, tie.low, tie.high, tie.queries) == (0.0, 0.0, 0.0, 60)
    # A query only one model embedded (an image unreadable in one pass) is left out of the pair.
    fewer = SplitScores(champion.metrics, champion.queries[1:],
                        {"recall@1": champion.per_query["recall@1"][1:]})
    assert compare(fewer, champion, 4, RegistryConfig()).queries == 59
    challenger = scores(np.random.default_rng(1).integers(0, 2, 60))
    cfg = RegistryConfig(bootstrap_seed=3, bootstrap_resamples=2000, confidence=0.9)
    first = compare(challenger, champion, 4, cfg)
    assert first == compare(challenger, champion, 4, cfg)
    assert (first.seed, first.resamples, first.confidence) == (3, 2000, 0.9)
    assert "(90% paired bootstrap, 2000 resamples, 60 queries)" in first.interval()


def test_the_gate_never_runs_on_the_test_split_and_needs_enough_resamples():
    with pytest.raises(ConfigError, match="registry.gate_split: 'test' is the test protocol"):
        load_params(ROOT / "params.yaml", ["registry.gate_split=test"])
    with pytest.raises(ConfigError, match="registry.bootstrap_resamples"):
        load_params(ROOT / "params.yaml", ["registry.bootstrap_resamples=999"])
    with pytest.raises(ConfigError, match="registry.primary_metric"):
        load_params(ROOT / "params.yaml", ["registry.primary_metric=nmi"])  # not a per-query metric
    assert load_params(ROOT / "params.yaml").registry.gate_split == "val"


def test_a_recorded_comparison_reads_back_as_the_same_comparison():
    comparison = compare(scores(hits(40, 30), nmi=0.5), scores(hits(40, 20)), 4, RegistryConfig())
    assert Comparison.from_dict(comparison.as_dict()) == comparison
    assert comparison.short() == (f"{comparison.difference:+.4f} [{comparison.low:+.4f}, "
                                  f"{comparison.high:+.4f}] vs v4")
