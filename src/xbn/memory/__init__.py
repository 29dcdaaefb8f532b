"""The cross-batch memory and the moment estimators that correct its drift (XBN, AXBN, EMA, auto)."""

from xbn.memory.cross_batch import CrossBatchMemory
from xbn.memory.moments import AdaptiveKalmanMoments, BatchMoments, EMAMoments, KalmanMoments, MomentEstimator

__all__ = ["AdaptiveKalmanMoments", "BatchMoments", "CrossBatchMemory", "EMAMoments", "KalmanMoments",
           "MomentEstimator"]
