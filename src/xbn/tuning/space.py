"""The search space of `tune.space`: what a trial samples, and the params overrides that turns into.

Optuna parameter names are the dotted params keys, so plots, importances and MLflow params read like
params.yaml. In `tune.lambda_mode` the two Kalman noises are one dimension, `memory.kalman.r/q` (given in the
space, or the range that its r and q entries span):
the static filter's gain sequence is unchanged when p0, q and r are scaled together (K = (P + q) /
(P + q + r/|B|), P scales with them), so (p0, q, r) runs exactly as (p0/q, 1, r/q). A trial therefore samples
lambda = r/q and runs q = 1, r = lambda, p0 = p0/q.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from xbn.config import BATCH_KEY, LAMBDA_KEY, ConfigError, Params, TuneConfig, flatten, load_params

log = logging.getLogger(__name__)

LAMBDA = LAMBDA_KEY
Dimension = TuneConfig.Dimension


def yaml_scalar(value: Any) -> str:
    """A value as `--set` text that YAML reads back as the same value (1e-05 must stay a float)."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def as_overrides(values: Mapping[str, Any]) -> list[str]:
    return [f"{key}={yaml_scalar(value)}" for key, value in values.items()]


def batch_ladder(max_batch_size: int, samples_per_class: int) -> list[int]:
    """The batch sizes a study with `tune.max_batch_size` tries: 4, 8, 16, ... classes a batch (doubling, the
    grid of issue 30) and the largest whole number of classes that fits, which is the baseline to beat with a
    memory at a smaller batch."""
    largest = max_batch_size // samples_per_class * samples_per_class
    if largest < 4 * samples_per_class:
        raise ConfigError(f"tune.max_batch_size: {max_batch_size} holds fewer than 4 classes of "
                          f"train.samples_per_class ({samples_per_class}); a batch needs at least "
                          f"{4 * samples_per_class}")
    ladder = [4 * samples_per_class * 2 ** i for i in range(32) if 4 * samples_per_class * 2 ** i < largest]
    return ladder + [largest]


@dataclass(frozen=True)
class SearchSpace:
    dims: dict[str, Dimension]  # Optuna parameter name -> dimension
    lambda_mode: bool = False

    @classmethod
    def from_config(cls, cfg: TuneConfig, samples_per_class: int | None = None) -> SearchSpace:
        dims = dict(cfg.space)
        if cfg.max_batch_size is not None and BATCH_KEY not in dims:
            if samples_per_class is None:
                raise ValueError("tune.max_batch_size needs train.samples_per_class to build the batch ladder")
            dims[BATCH_KEY] = Dimension(type="categorical",
                                        choices=batch_ladder(cfg.max_batch_size, samples_per_class))
        if cfg.lambda_mode and LAMBDA not in dims and "memory.kalman.r" in dims:
            r, q = dims.pop("memory.kalman.r"), dims.pop("memory.kalman.q")
            (r_low, r_high), (q_low, q_high) = r.bounds, q.bounds
            ratio = Dimension(type="float", low=r_low / q_high, high=r_high / q_low, log=r.log or q.log)
            dims = {LAMBDA: ratio, **dims}
        return cls(dims, cfg.lambda_mode)

    def sample(self, trial) -> dict[str, Any]:
        """Ask the trial (an `optuna.Trial` or `FixedTrial`) for one value per dimension."""
        values: dict[str, Any] = {}
        for name, d in self.dims.items():
            if d.type == "categorical":
                values[name] = trial.suggest_categorical(name, d.options)
            elif d.type == "int":
                low, high = d.bounds
                values[name] = trial.suggest_int(name, int(low), int(high), log=d.log, step=int(d.step or 1))
            else:
                values[name] = trial.suggest_float(name, *d.bounds, log=d.log, step=d.step)
        return values

    def to_params(self, sampled: Mapping[str, Any], base: Params) -> dict[str, Any]:
        """Sampled values -> the params keys they set (lambda becomes q = 1, r = lambda, p0 = p0/q)."""
        values = dict(sampled)
        if LAMBDA in values:
            kalman = base.memory.kalman
            values = {"memory.kalman.p0": kalman.p0 / kalman.q, "memory.kalman.q": 1.0,
                      "memory.kalman.r": values.pop(LAMBDA), **values}
        return values

    def current(self, base: Params) -> dict[str, Any]:
        """The base params as sampled values (the baseline trial); values outside the space are left out."""
        flat = flatten(base)
        values = {}
        for name, d in self.dims.items():
            value = base.memory.kalman.r / base.memory.kalman.q if name == LAMBDA else flat.get(name)
            inside = value in d.options if d.type == "categorical" else (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and d.bounds[0] <= value <= d.bounds[1])
            if inside:
                values[name] = value
        return values

    def check(self, params_file: str | Path, base: Params) -> None:
        """Every bound and choice must give valid params with the base ones: a bad one is refused by its key
        before any trial runs (a trial would otherwise fail on it hours later)."""
        for name, d in self.dims.items():
            for value in d.options if d.type == "categorical" else d.bounds:
                try:
                    load_params(params_file, as_overrides(self.to_params({name: value}, base)))
                except ConfigError as exc:
                    raise ConfigError(f"tune.space.{name}: {value!r} gives invalid params: {exc}") from None
        unused = [n for n in self.dims if n.startswith("memory.kalman.")]
        if unused and base.memory.method != "axbn" and "memory.method" not in self.dims:
            log.warning("tune.space has %s but memory.method is %s: they change nothing", unused,
                        base.memory.method)
