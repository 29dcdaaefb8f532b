"""The memory methods by name, and `cross_batch_memory`, which builds one for a pytorch-metric-learning loss.

This is xbn as a light library: it needs torch and pytorch-metric-learning only (`pip install xbn`, no extras),
so it imports nothing of the pipeline (no params schema: each argument is checked here, by name). The
pipeline's criterion builds its memory through the same function (`training.criterion.build_criterion`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import nn

from xbn.memory.cross_batch import CrossBatchMemory
from xbn.memory.moments import AdaptiveKalmanMoments, BatchMoments, EMAMoments, KalmanMoments, MomentEstimator

# method -> what corrects the stored rows' drift before each step (None: the rows stay as written).
METHODS: dict[str, str] = {
    "xbm": "pytorch-metric-learning's memory: the rows as they were written (Wang et al., CVPR 2020)",
    "xbn": "the rows rescaled to the batch's per-dimension mean and std every step (seed 000, Eq. 6)",
    "axbn": "the rows rescaled to a per-dimension Kalman estimate of the dataset's moments (seed 000, Eq. 18-23)",
    "ema": "the rows rescaled to an exponential moving average of the batch's moments (seed 000, App. C)",
    "axbn_auto": "AXBN whose process noise is estimated from the innovations (no q or r to tune)",
}
# AXBN's filter, seed 000's values (Sec. 5.1, Algorithm 1): P0 = 1, Q = 1, R = r/|B| with r = 0.01, the gain
# recomputed every N = 100 iterations. The pipeline's defaults are the same (params.yaml, memory.kalman).
KALMAN = {"p0": 1.0, "q": 1.0, "r": 0.01, "gain_interval": 100}
# params.yaml's memory.* keys that belong to xbn's training loop, not to the memory: what to do instead.
LOOP_KEYS = {
    "size": "memory_size is the number of rows (params.yaml's memory.size is a share of the training set)",
    "start": "the memory joins when your loop first calls it: call the plain loss until then",
    "delay_steps": "the memory joins when your loop first calls it: call the plain loss until then",
    "add_batch_loss": "add the loss on the batch alone in your loop: memory_loss(e, y) + loss(e, y)",
    "oracle_every": "the oracle re-embeds stored inputs inside xbn's trainer: run `xbn train` for it",
    "mine": "pass miner=None to take every pair against the memory",
}


def moment_estimator(method: str, dim: int, kalman: Mapping[str, float] | None = None, ema_momentum: float = 0.1,
                     innovation_momentum: float = 0.05) -> MomentEstimator | None:
    """The drift correction of `method` for `dim`-dimensional rows (None for xbm). Every value is checked here
    and a wrong one is a ValueError naming it."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: one of {', '.join(METHODS)}")
    if method == "xbn":
        return BatchMoments()
    if method == "axbn":
        unknown = sorted(set(kalman or {}) - set(KALMAN))
        if unknown:
            raise ValueError(f"kalman: unknown key(s) {', '.join(unknown)}; the filter's are {', '.join(KALMAN)}")
        k = {**KALMAN, **(kalman or {})}
        _check_number("kalman.p0", k["p0"], 0.0, 1e12)
        _check_number("kalman.q", k["q"], 0.0, 1e12, above=True)
        _check_number("kalman.r", k["r"], 0.0, 1e12)
        _check_number("kalman.gain_interval", k["gain_interval"], 1, None, whole=True)
        return KalmanMoments(dim, p0=k["p0"], q=k["q"], r=k["r"], gain_interval=int(k["gain_interval"]))
    if method == "ema":
        _check_number("ema_momentum", ema_momentum, 0.0, 1.0, below=True)
        return EMAMoments(dim, ema_momentum)
    if method == "axbn_auto":
        _check_number("innovation_momentum", innovation_momentum, 0.0, 1.0, above=True)
        return AdaptiveKalmanMoments(dim, innovation_momentum)
    return None  # xbm


# The methods whose memory loss is centred unless told otherwise (issue 52, docs/method.md): XBM's rows are stored
# as written, and with the minibatch loss and a margin miner its uncentred gradient let the batch run from them as
# one (sop_like, 5 seeds: every image at one point at batch 16, -0.098 R@1 against no memory at 64; centred,
# +0.006 and +0.027). The mapped methods put the memory's mean on the batch's, and centring measured neutral there.
# The pipeline's `memory.center_gradient: auto` is the same rule (MemoryConfig.centred; the oracle's memory is XBM's).
CENTRED_BY_DEFAULT = frozenset({"xbm"})


def centred_by_default(method: str) -> bool:
    return method in CENTRED_BY_DEFAULT


def cross_batch_memory(loss: nn.Module, embedding_size: int, memory_size: int, method: str = "xbn",
                       miner: nn.Module | None = None, *, kalman: Mapping[str, float] | None = None,
                       ema_momentum: float = 0.1, innovation_momentum: float = 0.05, exclude_self: bool = False,
                       attach_batch: bool = False, center_gradient: bool | str = "auto", no_positive: str = "all_pairs",
                       **loop_keys: object) -> CrossBatchMemory:
    """A drop-in for pytorch-metric-learning's `CrossBatchMemory` whose stored embeddings follow the network's
    drift. `method`: one of `METHODS` (xbn, axbn, ema, axbn_auto; xbm for PML's memory, rows as written).

        loss_fn = cross_batch_memory(losses.ContrastiveLoss(), embedding_size=128, memory_size=4096)
        loss = loss_fn(embeddings, labels) + inner_loss(embeddings, labels)  # the memory's + the batch's

    The keywords are params.yaml's `memory.*` keys of the same names: `kalman` (AXBN's p0, q, r,
    gain_interval; those left out keep seed 000's values), `ema_momentum`, `innovation_momentum`, `exclude_self`,
    `attach_batch`, `center_gradient` ("auto": on for xbm, off for the methods that map the rows onto the batch;
    `CENTRED_BY_DEFAULT`), and `no_positive` (params.yaml's loss.no_positive: "all_pairs" takes a
    step whose mined pairs hold no positive over all pairs instead, for losses that need one).

    Add the loss on the batch alone in your loop, as xbn's pipeline does (`memory.add_batch_loss`): alone, the
    memory loss lost to no memory in most of xbn's measurements (docs/method.md). The keys of xbn's training
    loop (`LOOP_KEYS`: size, start, delay_steps, add_batch_loss, oracle_every, mine) are refused with what to do
    instead; so are `none` and `oracle`, which are not memories a loss can hold."""
    if loop_keys:
        raise TypeError("cross_batch_memory: " + "; ".join(
            f"{key} is not the memory's: {LOOP_KEYS[key]}" if key in LOOP_KEYS else f"unknown keyword {key!r}"
            for key in sorted(loop_keys)))
    if method in ("none", "oracle"):
        raise ValueError(f"method={method!r} is not a memory to build: "
                         + ("use the loss alone" if method == "none" else
                            "the drift-free oracle re-embeds stored inputs inside xbn's trainer (`xbn train`)"))
    _check_number("embedding_size", embedding_size, 1, None, whole=True)
    _check_number("memory_size", memory_size, 1, None, whole=True)
    if center_gradient not in ("auto", True, False):
        raise ValueError(f"center_gradient={center_gradient!r}: expected 'auto', True or False")
    if no_positive not in ("all_pairs", "zero"):
        raise ValueError(f"no_positive={no_positive!r}: expected 'all_pairs' or 'zero'")
    moments = moment_estimator(method, int(embedding_size), kalman, ema_momentum, innovation_momentum)
    return CrossBatchMemory(loss, int(embedding_size), memory_size=int(memory_size), miner=miner, moments=moments,
                            exclude_self=bool(exclude_self), attach_batch=bool(attach_batch),
                            no_positive=no_positive,
                            center_gradient=centred_by_default(method) if center_gradient == "auto"
                            else bool(center_gradient))


def _check_number(name: str, value: object, low: float, high: float | None, above: bool = False,
                  below: bool = False, whole: bool = False) -> None:
    """A ValueError naming `name` unless `value` is a number from `low` to `high` (`above`/`below`: excluded)."""
    v = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan  # nan: fails
    ok = (v > low if above else v >= low) and (high is None or (v < high if below else v <= high)) and (
        not whole or v.is_integer())
    if not ok:
        bounds = f"{'above' if above else 'at least'} {low:g}" + (
            "" if high is None else f" and {'below' if below else 'at most'} {high:g}")
        raise ValueError(f"{name}={value!r}: expected {'a whole number' if whole else 'a number'} {bounds}")
