"""The promotion gate alone: a pure function of the challenger's metrics and the champion's tags."""

from __future__ import annotations

from xbn.config import RegistryConfig
from xbn.stages.register import gate
from xbn.tracking import ModelVersionInfo, metric_tags

CHAMPION = {"recall@1": 0.50, "recall@10": 0.80, "map@r": 0.30, "r_precision": 0.35, "nmi": 0.60}


def champion(metrics=CHAMPION, data="d1") -> ModelVersionInfo:
    return ModelVersionInfo("m", 4, "run", "2026-01-01T00:00:00+00:00", "models:/x",
                            tags={"data_hash": data, **metric_tags(metrics)})


def test_no_champion_promotes():
    assert gate(CHAMPION, None, "d1", RegistryConfig()).promote


def test_the_primary_metric_must_improve_by_the_minimum():
    cfg = RegistryConfig(min_improvement=0.02)
    assert not gate({**CHAMPION}, champion(), "d1", RegistryConfig()).promote  # a tie is not an improvement
    assert not gate({**CHAMPION, "recall@1": 0.51}, champion(), "d1", cfg).promote
    decision = gate({**CHAMPION, "recall@1": 0.52}, champion(), "d1", cfg)
    assert decision.promote and decision.decision == "promoted" and "+0.0200" in decision.reason


def test_guarded_metrics_may_fall_only_within_the_tolerance():
    better = {**CHAMPION, "recall@1": 0.60}
    assert gate({**better, "nmi": 0.59}, champion(), "d1", RegistryConfig(tolerance=0.01)).promote
    worse = {**better, "nmi": 0.58, "r_precision": 0.30}
    decision = gate(worse, champion(), "d1", RegistryConfig(tolerance=0.01))
    assert decision.decision == "rejected"
    assert "nmi fell by 0.0200" in decision.reason and "r_precision fell by 0.0500" in decision.reason
    missing = {k: v for k, v in better.items() if k != "recall@10"}
    assert "recall@10 was not measured" in gate(missing, champion(), "d1", RegistryConfig()).reason


def test_other_evaluation_data_is_never_compared():
    decision = gate({**CHAMPION, "recall@1": 0.99}, champion(data="d1"), "d2", RegistryConfig())
    assert decision.decision == "held" and not decision.promote and "other data" in decision.reason


def test_metric_tags_round_trip_at_full_precision():
    info = champion({"recall@1": 0.1 + 0.2, "map@r": 1 / 3})
    assert info.metrics == {"recall@1": 0.1 + 0.2, "map@r": 1 / 3}
