"""params.yaml: every stage reads its settings through `load_params`, which validates them first.

An unknown key, a wrong type or an impossible value raises `ConfigError` naming the dotted key, before any
work starts (the CLI turns it into exit 2). The schema is in `schema.py`, the `--set` parser in
`overrides.py`, the checks of `tune.space` in `tune_space.py`.
"""

from xbn.config.errors import ConfigError, close_matches
from xbn.config.loading import flatten, load_params
from xbn.config.overrides import apply_overrides
from xbn.config.schema import (
    BATCH_KEY,
    DATASETS,
    DEVICES,
    LAMBDA_KEY,
    MEMORY_METHODS,
    CatalogueConfig,
    DataConfig,
    EvalConfig,
    GlyphsConfig,
    IndexConfig,
    InferenceConfig,
    KalmanConfig,
    LossConfig,
    MemoryConfig,
    MemVirConfig,
    ModelConfig,
    MpnConfig,
    Params,
    RefineConfig,
    RegistryConfig,
    RhoConfig,
    SamplerConfig,
    ServeConfig,
    TrackingConfig,
    TrainConfig,
    TuneConfig,
    ValidateConfig,
)

__all__ = ["BATCH_KEY", "DATASETS", "DEVICES", "LAMBDA_KEY", "MEMORY_METHODS", "CatalogueConfig", "ConfigError", "DataConfig",
           "EvalConfig", "GlyphsConfig", "IndexConfig", "InferenceConfig", "KalmanConfig", "LossConfig",
           "MemVirConfig", "MemoryConfig", "ModelConfig", "MpnConfig", "Params", "RefineConfig", "RegistryConfig",
           "RhoConfig", "SamplerConfig", "ServeConfig", "TrackingConfig", "TrainConfig", "TuneConfig", "ValidateConfig",
           "apply_overrides", "close_matches", "flatten", "load_params"]
