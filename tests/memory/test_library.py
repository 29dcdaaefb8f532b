"""The memory as a library (`xbn.memory.cross_batch_memory`): every keyword it takes is used and checked by name,
the training loop's keys are refused with what to do instead, and the pipeline builds its memory through it."""

from __future__ import annotations

import inspect

import pytest
import torch
from pytorch_metric_learning import losses, miners

from xbn.config import load_params
from xbn.memory import (
    KALMAN,
    LOOP_KEYS,
    METHODS,
    AdaptiveKalmanMoments,
    BatchMoments,
    EMAMoments,
    KalmanMoments,
    cross_batch_memory,
    moment_estimator,
)
from xbn.training.criterion import build_criterion


def memory(**keywords):
    return cross_batch_memory(losses.ContrastiveLoss(), 8, 64, **keywords)


@pytest.mark.parametrize(("method", "estimator"), [("xbm", type(None)), ("xbn", BatchMoments),
                                                   ("axbn", KalmanMoments), ("ema", EMAMoments),
                                                   ("axbn_auto", AdaptiveKalmanMoments)])
def test_each_method_builds_its_own_drift_correction(method, estimator):
    assert method in METHODS and isinstance(memory(method=method).moments, estimator)


def test_every_keyword_reaches_the_memory():
    built = memory(method="axbn", kalman={"r": 0.5}, exclude_self=True, attach_batch=True, center_gradient=True,
                   no_positive="zero", miner=miners.PairMarginMiner())
    k = built.moments
    assert (k.r, k.q, k.gain_interval) == (0.5, KALMAN["q"], KALMAN["gain_interval"])  # the rest: seed 000's
    assert float(k.covariance[0]) == KALMAN["p0"]
    assert built.exclude_self and built.attach_batch and built.center_gradient and not built.repair_no_positive
    assert isinstance(built.miner, miners.PairMarginMiner)
    assert memory(method="ema", ema_momentum=0.3).moments.momentum == 0.3
    assert memory(method="axbn_auto", innovation_momentum=0.2).moments.innovation_momentum == 0.2


def test_the_librarys_defaults_are_the_pipelines():
    # Written twice by the layering (xbn.memory imports nothing of the params schema): kept equal here.
    from xbn.config.schema import KalmanConfig, LossConfig, MemoryConfig

    defaults = inspect.signature(cross_batch_memory).parameters
    shared = ("ema_momentum", "innovation_momentum", "exclude_self", "attach_batch", "center_gradient")
    assert {name: defaults[name].default for name in shared} == MemoryConfig().model_dump(include=set(shared))
    assert KALMAN == KalmanConfig().model_dump()
    assert defaults["no_positive"].default == LossConfig().no_positive


@pytest.mark.parametrize("key", sorted(LOOP_KEYS))
def test_the_training_loops_keys_are_refused_with_what_to_do_instead(key):
    with pytest.raises(TypeError, match=rf"{key} is not the memory's: {LOOP_KEYS[key][:20]}"):
        memory(**{key: 1})


@pytest.mark.parametrize(("keywords", "named"), [
    ({"method": "xbnn"}, "method='xbnn'"), ({"method": "none"}, "use the loss alone"),
    ({"method": "oracle"}, "re-embeds stored inputs"), ({"ema_momentm": 0.2}, "unknown keyword 'ema_momentm'"),
    ({"method": "ema", "ema_momentum": 1.0}, "ema_momentum=1.0"),
    ({"method": "ema", "ema_momentum": "0.1"}, "ema_momentum='0.1'"),
    ({"method": "axbn", "kalman": {"q": 0}}, "kalman.q=0"),
    ({"method": "axbn", "kalman": {"r": float("nan")}}, "kalman.r=nan"),
    ({"method": "axbn", "kalman": {"gain_interval": 2.5}}, "kalman.gain_interval=2.5"),
    ({"method": "axbn", "kalman": {"R": 0.1}}, "unknown key.* R"),
    ({"method": "axbn_auto", "innovation_momentum": 0}, "innovation_momentum=0"),
    ({"no_positive": "skip"}, "no_positive='skip'"),
])
def test_a_wrong_value_is_named(keywords, named):
    with pytest.raises((TypeError, ValueError), match=named):
        memory(**keywords)


def test_a_wrong_size_is_named():
    with pytest.raises(ValueError, match="memory_size=0"):
        cross_batch_memory(losses.ContrastiveLoss(), 8, 0)
    with pytest.raises(ValueError, match="embedding_size=8.5"):
        cross_batch_memory(losses.ContrastiveLoss(), 8.5, 64)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["axbn", "ema", "axbn_auto", "oracle"])
def test_the_pipeline_builds_its_memory_through_the_library(method):
    # params.yaml's memory section reaches the same keywords: a value the schema accepted is the estimator's.
    params = load_params(None, [f"memory.method={method}", "memory.kalman.r=0.3", "memory.kalman.gain_interval=7",
                                "memory.ema_momentum=0.4", "memory.innovation_momentum=0.2",
                                "memory.center_gradient=true"])
    built = build_criterion(params, 64, train_labels=torch.arange(8).repeat(8).numpy()).memory
    expected = moment_estimator("xbm" if method == "oracle" else method, params.model.embedding_dim,
                                params.memory.kalman.model_dump(), 0.4, 0.2)
    assert type(built.moments) is type(expected) and built.center_gradient
    if method == "axbn":
        assert (built.moments.r, built.moments.gain_interval) == (0.3, 7)
    if method == "ema":
        assert built.moments.momentum == 0.4
    if method == "axbn_auto":
        assert built.moments.innovation_momentum == 0.2
