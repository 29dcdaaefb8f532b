"""xbn: drift-corrected cross-batch memory for deep metric learning.

The library, in a few names (imported on first use, so `import xbn` stays light):

- `cross_batch_memory(loss, embedding_size, memory_size, method="xbn")`: pytorch-metric-learning's
  `CrossBatchMemory` with its stored embeddings corrected for drift (XBN, AXBN, EMA), for your own loop;
  `CrossBatchMemory` is the class behind it.
- `load_params(path, overrides)`: params.yaml through the schema (every key checked, the error names it).
- `train(params)`, `evaluate(params)`, `embed(params, input, output)`: the pipeline's stages, as `xbn train`,
  `xbn evaluate` and `xbn embed` run them (files in, files out; each returns its report).
"""

from importlib import metadata

try:
    __version__ = metadata.version("xbn")  # pyproject.toml's, the one place it is written
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "cross_batch_memory": "xbn.memory",
    "CrossBatchMemory": "xbn.memory",
    "load_params": "xbn.config",
    "Params": "xbn.config",
    "train": "xbn.stages.train",
    "evaluate": "xbn.stages.evaluate",
    "embed": "xbn.stages.serve",
}
__all__ = ["__version__", *_EXPORTS]  # noqa: PLE0604 - the keys are strings


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'xbn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})  # the lazy names too, for dir(xbn) and completion
