"""The search space: validated by key before any trial, sampled into params, and lambda mode's claim that
(p0, q, r) and (p0/q, 1, r/q) are the same Kalman filter."""

from pathlib import Path

import optuna
import pytest
import torch
import yaml

from tests_support import ROOT
from xbn.config import ConfigError, load_params
from xbn.memory.moments import KalmanMoments
from xbn.tuning import LAMBDA, SearchSpace, as_overrides
from xbn.tuning.report import batch_verdict
from xbn.tuning.space import batch_ladder
from xbn.tuning.storage import resolve_storage


def params_with_space(tmp_path: Path, space: dict, **tune) -> Path:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["tune"].update(space=space, **tune)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("space, named", [
    ({"memory.kalman.rr": {"type": "float", "low": 1, "high": 2}}, r"'memory\.kalman\.rr' is not a params"),
    ({"memroy.size": {"type": "float", "low": 0.1, "high": 1}}, r"'memroy\.size' is not a params key"),
    ({"memory.kalman": {"type": "float", "low": 1, "high": 2}}, r"'memory\.kalman' is a section"),
    ({"memory.method.x": {"type": "categorical", "choices": [1]}}, r"'method' is a value"),
    ({"tune.epochs": {"type": "int", "low": 1, "high": 3}}, r"'tune\.epochs' cannot be tuned"),
    ({"memory.size": {"type": "float", "low": 1, "high": 0.1}}, r"tune\.space\.memory\.size: .*low <= high"),
    ({"memory.kalman.r": {"type": "float", "low": 0, "high": 1, "log": True}}, r"kalman\.r: .*low > 0"),
    ({"train.batch_size": {"type": "int", "low": 8, "high": 64.5}}, r"train\.batch_size: .*whole"),
    ({"memory.method": {"type": "categorical", "choices": []}}, r"memory\.method: .*choices"),
])
def test_a_bad_space_is_refused_at_load_naming_the_key(tmp_path, space, named):
    with pytest.raises(ConfigError, match=named):
        load_params(params_with_space(tmp_path, space))


def test_free_form_mappings_accept_new_keys(tmp_path):
    p = load_params(params_with_space(tmp_path, {"loss.params.temperature": {"type": "float", "low": 0.05,
                                                                             "high": 0.5}}))
    assert "loss.params.temperature" in p.tune.space


def test_a_bound_the_schema_refuses_is_named_before_any_trial(tmp_path):
    path = params_with_space(tmp_path, {"memory.kalman.q": {"type": "float", "low": 0.0, "high": 1.0}},
                             lambda_mode=False)
    base = load_params(path)
    with pytest.raises(ConfigError, match=r"tune\.space\.memory\.kalman\.q: 0\.0 .*memory\.kalman\.q"):
        SearchSpace.from_config(base.tune).check(path, base)
    per_class = {"type": "categorical", "choices": [4, 5]}
    path = params_with_space(tmp_path, {"train.samples_per_class": per_class})
    with pytest.raises(ConfigError, match=r"samples_per_class: 5 .*divisible"):
        SearchSpace.from_config(load_params(path).tune).check(path, load_params(path))


def test_lambda_mode_needs_r_and_q(tmp_path):
    with pytest.raises(ConfigError, match=r"lambda_mode needs .*memory\.kalman\.q"):
        load_params(params_with_space(tmp_path, {"memory.kalman.r": {"type": "float", "low": 1, "high": 2}},
                                      lambda_mode=True))


def test_the_default_space_asks_whether_a_memory_helps_and_holds_the_papers_lambda():
    space = SearchSpace.from_config(load_params(ROOT / "params.yaml").tune)
    assert "none" in space.dims["memory.method"].choices and "memory.size" in space.dims
    lam = space.dims[LAMBDA]
    assert (lam.low, lam.high, lam.log) == (1e-4, 1e4, True) and lam.low < 0.01 < lam.high  # seed 000: 0.01


def test_lambda_given_directly_needs_lambda_mode(tmp_path):
    with pytest.raises(ConfigError, match=r"memory\.kalman\.r/q needs tune\.lambda_mode: true"):
        load_params(params_with_space(tmp_path, {LAMBDA: {"type": "float", "low": 1, "high": 2}},
                                      lambda_mode=False))


def test_sampled_values_become_the_trial_params(tmp_path):
    path = params_with_space(tmp_path, {
        "memory.kalman.r": {"type": "float", "low": 1e-4, "high": 10.0, "log": True},
        "memory.kalman.q": {"type": "float", "low": 1e-6, "high": 1e-2, "log": True},
        "memory.size": {"type": "float", "low": 0.05, "high": 1.0},
        "memory.kalman.gain_interval": {"type": "categorical", "choices": [1, 10, 100]}}, lambda_mode=False)
    base = load_params(path)
    space = SearchSpace.from_config(base.tune)
    fixed = {"memory.kalman.r": 0.03, "memory.kalman.q": 2e-6, "memory.size": 0.25,
             "memory.kalman.gain_interval": 100}
    sampled = space.sample(optuna.trial.FixedTrial(fixed))
    trial = load_params(path, as_overrides(space.to_params(sampled, base)))
    k = trial.memory.kalman
    assert (k.r, k.q, trial.memory.size, k.gain_interval) == (0.03, 2e-6, 0.25, 100)
    assert isinstance(k.gain_interval, int)
    # The current params lie in the space (q = 1 is above its range, so q is left out): the baseline trial.
    assert space.current(base) == {"memory.kalman.r": 0.01, "memory.size": 1.0, "memory.kalman.gain_interval": 100}


def test_the_default_space_samples_into_params():
    base = load_params(ROOT / "params.yaml")
    space = SearchSpace.from_config(base.tune)
    fixed = {"memory.method": "axbn", "memory.size": 0.25, "memory.add_batch_loss": True, LAMBDA: 0.03,
             "memory.kalman.gain_interval": 10}
    values = space.to_params(space.sample(optuna.trial.FixedTrial(fixed)), base)
    trial = load_params(ROOT / "params.yaml", as_overrides(values))
    k = trial.memory.kalman
    assert (trial.memory.method, trial.memory.size, trial.memory.add_batch_loss, k.r, k.q, k.p0,
            k.gain_interval) == ("axbn", 0.25, True, 0.03, 1.0, 1.0, 10)
    assert space.current(base) == {"memory.method": base.memory.method, "memory.size": 1.0,
                                   "memory.add_batch_loss": base.memory.add_batch_loss, LAMBDA: 0.01,
                                   "memory.kalman.gain_interval": 100}


def test_lambda_mode_is_the_same_filter_with_one_dimension_fewer(tmp_path):
    path = params_with_space(tmp_path, {
        "memory.kalman.r": {"type": "float", "low": 1e-4, "high": 10.0, "log": True},
        "memory.kalman.q": {"type": "float", "low": 1e-6, "high": 1e-2, "log": True}}, lambda_mode=True)
    base = load_params(path, ["memory.kalman.p0=2.0", "memory.kalman.q=1e-4", "memory.kalman.r=1.0"])
    space = SearchSpace.from_config(base.tune)
    lam = space.dims[LAMBDA]
    # lambda = r/q over exactly the range the r and q entries span
    assert (lam.low, lam.high, lam.log) == pytest.approx((1e-4 / 1e-2, 10.0 / 1e-6, True))
    assert not {"memory.kalman.r", "memory.kalman.q"} & space.dims.keys()
    values = space.to_params({LAMBDA: 250.0}, base)
    assert values["memory.kalman.q"] == 1.0 and values["memory.kalman.r"] == 250.0
    assert space.current(base)[LAMBDA] == pytest.approx(1.0 / 1e-4)

    q = base.memory.kalman.q
    original = KalmanMoments(4, p0=2.0, q=q, r=250.0 * q)
    rescaled = KalmanMoments(4, p0=values["memory.kalman.p0"], q=1.0, r=250.0)
    for batch in (64, 64, 32, 64, 128) * 4:
        torch.testing.assert_close(original.next_gain(batch), rescaled.next_gain(batch), rtol=1e-9, atol=0)


def test_storage_defaults_and_parallel_sqlite_refused():
    cfg = load_params(ROOT / "params.yaml").tune
    assert resolve_storage(cfg, 1).url == "sqlite:///tuning/optuna.db"
    assert resolve_storage(cfg, 3).url == "journal:tuning/optuna.journal"
    with pytest.raises(ConfigError, match="SQLite is not safe for parallel workers"):
        resolve_storage(cfg.model_copy(update={"storage": "sqlite:///x.db"}), 2)
    pg = resolve_storage(cfg.model_copy(update={"storage": "postgresql://u:secret@db/optuna"}), 4)
    assert pg.kind == "postgresql" and "secret" not in pg.redacted() and pg.heartbeats


def test_the_cli_refuses_a_bad_bound_by_key_before_any_work(tmp_path, monkeypatch, capsys):
    from xbn.cli import main

    monkeypatch.chdir(tmp_path)
    path = params_with_space(tmp_path, {"memory.kalman.q": {"type": "float", "low": 0.0, "high": 1.0}},
                             lambda_mode=False)
    assert main(["tune", "--params", str(path)]) == 2
    assert "tune.space.memory.kalman.q: 0.0" in capsys.readouterr().err
    assert main(["tune", "--params", str(ROOT / "params.yaml"), "--worker", "--apply"]) == 2
    assert "--apply merges the study's result" in capsys.readouterr().err
    assert not (tmp_path / "tuning/optuna.db").exists()


@pytest.mark.parametrize("budget, per_class, ladder", [
    (64, 4, [16, 32, 64]), (100, 4, [16, 32, 64, 100]), (50, 4, [16, 32, 48]), (16, 4, [16]), (96, 8, [32, 64, 96]),
])
def test_max_batch_size_gives_doubling_classes_up_to_the_largest_that_fits(budget, per_class, ladder):
    assert batch_ladder(budget, per_class) == ladder


def test_a_budget_under_four_classes_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"tune\.max_batch_size: 12 .*at least 16"):
        batch_ladder(12, 4)


def test_max_batch_size_adds_the_batch_to_the_space_and_every_choice_is_valid(tmp_path):
    path = params_with_space(tmp_path, {"memory.method": {"type": "categorical", "choices": ["none", "xbm", "xbn"]}},
                             max_batch_size=64)
    base = load_params(path)
    space = SearchSpace.from_config(base.tune, base.train.samples_per_class)
    assert space.dims["train.batch_size"].choices == [16, 32, 64]
    space.check(path, base)  # 16, 32 and 64 all divide by train.samples_per_class
    sampled = space.sample(optuna.trial.FixedTrial({"memory.method": "xbn", "train.batch_size": 16}))
    assert load_params(path, as_overrides(space.to_params(sampled, base))).train.batch_size == 16
    assert space.current(base) == {"memory.method": base.memory.method, "train.batch_size": 64}
    assert "train.batch_size" not in SearchSpace.from_config(load_params(ROOT / "params.yaml").tune).dims


def test_a_batch_in_the_space_above_the_budget_is_refused_naming_both(tmp_path):
    path = params_with_space(tmp_path, {"train.batch_size": {"type": "categorical", "choices": [16, 128]}},
                             max_batch_size=64)
    with pytest.raises(ConfigError, match=r"tune\.space\.train\.batch_size: 128 is above tune\.max_batch_size "
                                          r"\(64\)"):
        load_params(path)


def _trial(number: int, method: str, batch: int, value: float) -> optuna.trial.FrozenTrial:
    dists = {"memory.method": optuna.distributions.CategoricalDistribution(["none", "axbn"]),
             "train.batch_size": optuna.distributions.CategoricalDistribution([16, 32, 64])}
    trial = optuna.trial.create_trial(params={"memory.method": method, "train.batch_size": batch},
                                      distributions=dists, value=value)
    trial.number = number
    return trial


def test_the_batch_verdict_compares_a_memory_at_a_smaller_batch_with_none_at_the_largest():
    base = load_params(ROOT / "params.yaml")
    batch = SearchSpace.from_config(base.tune.model_copy(update={"max_batch_size": 64}), 4).dims["train.batch_size"]
    trials = [_trial(0, "none", 64, 0.70), _trial(1, "axbn", 16, 0.74), _trial(2, "none", 16, 0.80),
              _trial(3, "axbn", 64, 0.90)]  # neither #2 (no memory, small batch) nor #3 (batch 64) is compared
    text = batch_verdict(trials, base, batch)
    assert text.startswith("A memory at batch 16 (axbn, #1: ") and "beats no memory at batch 64 (#0: 0.7000" in text
    assert "+0.0400" in text
    assert "does not beat" in batch_verdict([_trial(0, "none", 64, 0.75), _trial(1, "axbn", 32, 0.74)], base, batch)
    assert "No complete trial without a memory at batch 64" in batch_verdict(trials[1:], base, batch)
