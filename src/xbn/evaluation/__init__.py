"""Retrieval evaluation: exact chunked kNN search, the DML metrics computed from it (per query too), and the
paired bootstrap that compares two models on the same queries."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xbn.evaluation.bootstrap import PairedInterval, paired_bootstrap
    from xbn.evaluation.knn import knn_search
    from xbn.evaluation.metrics import QueryScores, retrieval_metrics

# Loaded on first use (PEP 562): `knn` imports torch (seconds in a fresh process), and the registry's checks that
# every scheduled run makes, a nothing-changed one too, need only `bootstrap` (xbn.stages.promotion).
_EXPORTS = {"PairedInterval": "bootstrap", "paired_bootstrap": "bootstrap", "knn_search": "knn",
            "QueryScores": "metrics", "retrieval_metrics": "metrics"}
__all__ = ["PairedInterval", "QueryScores", "knn_search", "paired_bootstrap", "retrieval_metrics"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
