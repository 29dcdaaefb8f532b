"""Retrieval evaluation: exact chunked kNN search, the DML metrics computed from it (per query too), and the
paired bootstrap that compares two models on the same queries."""

from xbn.evaluation.bootstrap import PairedInterval, paired_bootstrap
from xbn.evaluation.knn import knn_search
from xbn.evaluation.metrics import QueryScores, retrieval_metrics

__all__ = ["PairedInterval", "QueryScores", "knn_search", "paired_bootstrap", "retrieval_metrics"]
