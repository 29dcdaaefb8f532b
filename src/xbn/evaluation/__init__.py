"""Retrieval evaluation: exact chunked kNN search and the DML metrics computed from it."""

from xbn.evaluation.knn import knn_search
from xbn.evaluation.metrics import retrieval_metrics

__all__ = ["knn_search", "retrieval_metrics"]
