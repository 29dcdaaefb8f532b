"""The cross-batch memory as a library: `cross_batch_memory` for a pytorch-metric-learning loss, the methods by
name (`METHODS`), and the moment estimators that correct the stored rows' drift (XBN, AXBN, EMA, auto). Needs
torch and pytorch-metric-learning only: nothing here imports the pipeline (tests/architecture/test_layers.py)."""

from xbn.memory.cross_batch import CrossBatchMemory
from xbn.memory.methods import KALMAN, LOOP_KEYS, METHODS, cross_batch_memory, moment_estimator
from xbn.memory.moments import AdaptiveKalmanMoments, BatchMoments, EMAMoments, KalmanMoments, MomentEstimator

__all__ = ["KALMAN", "LOOP_KEYS", "METHODS", "AdaptiveKalmanMoments", "BatchMoments", "CrossBatchMemory",
           "EMAMoments", "KalmanMoments", "MomentEstimator", "cross_batch_memory", "moment_estimator"]
