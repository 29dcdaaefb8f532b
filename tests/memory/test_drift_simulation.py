"""A drift whose right answer is known: the memory that rescales its rows (XBN, AXBN) retrieves the current
batch's classes as well as rows re-embedded by the current network would; stale rows (XBM) do not.

Embeddings z_t = a_t * (c_y + noise) + b_t, with per-dimension a_t (log-random walk) and b_t (random walk)
that drift at every step, as a network's features do while it trains. The stream goes through the real
`CrossBatchMemory`; after each update the current batch's queries are scored (R@1, Euclidean) against
the memory's other rows, and against the same rows written as the current step's (a_t, b_t) would map them
(`fresh`: what a perfect correction gives, limited only by which classes the memory holds).
"""

import pytest
import torch
from pytorch_metric_learning import losses

from xbn.memory import CrossBatchMemory
from xbn.memory.moments import BatchMoments, KalmanMoments

DIM, CLASSES, CLASSES_PER_BATCH, PER_CLASS, ROWS, STEPS, SCORED_FROM = 16, 100, 32, 2, 320, 50, 10
LOG_SCALE_STEP, SHIFT_STEP, NOISE = 0.05, 1.0, 0.3


def stream_scores(moments, seed: int = 0) -> tuple[float, float]:
    """Mean R@1 of the current batch against the memory's other rows (steps SCORED_FROM..), and the same with
    those rows as the current (a_t, b_t) would map their clean values."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, DIM, generator=g)
    log_scale, shift = torch.zeros(DIM), torch.zeros(DIM)
    memory = CrossBatchMemory(losses.SupConLoss(), DIM, ROWS, moments=moments)
    clean = torch.zeros(ROWS, DIM)  # the rows' values before any (a, b)
    scores, fresh_scores = [], []
    for step in range(STEPS):
        log_scale += LOG_SCALE_STEP * torch.randn(DIM, generator=g)
        shift += SHIFT_STEP * torch.randn(DIM, generator=g)
        labels = torch.randperm(CLASSES, generator=g)[:CLASSES_PER_BATCH].repeat_interleave(PER_CLASS)
        x = centres[labels] + NOISE * torch.randn(len(labels), DIM, generator=g)
        z = log_scale.exp() * x + shift
        written = torch.arange(int(memory.queue_idx), int(memory.queue_idx) + len(labels)) % ROWS
        with torch.no_grad():
            memory(z, labels)
        clean[written] = x
        if step < SCORED_FROM:
            continue
        others = torch.ones(memory.num_valid, dtype=torch.bool)
        others[written] = False
        stored_labels = memory.label_memory[: memory.num_valid][others]
        for rows, out in ((memory.valid_rows()[others], scores),
                          (log_scale.exp() * clean[: memory.num_valid][others] + shift, fresh_scores)):
            nearest = torch.cdist(z, rows).argmin(1)
            out.append(float((stored_labels[nearest] == labels).float().mean()))
    return sum(scores) / len(scores), sum(fresh_scores) / len(fresh_scores)


@pytest.fixture(scope="module")
def scores() -> dict[str, float]:
    xbm, fresh = stream_scores(None)
    return {"xbm": xbm, "fresh": fresh, "xbn": stream_scores(BatchMoments())[0],
            "axbn": stream_scores(KalmanMoments(DIM, p0=1.0, q=1.0, r=0.01, gain_interval=100))[0]}


@pytest.mark.parametrize("method", ["xbn", "axbn"])
def test_moment_matching_beats_stale_rows_and_nearly_reaches_fresh_ones(scores, method):
    # Measured (seed 0): xbm 0.352, xbn 0.780, axbn 0.780 (the paper's r/|B| << q: a gain of ~1), fresh 0.782.
    print({k: round(v, 3) for k, v in scores.items()})
    assert scores[method] > scores["xbm"] + 0.25
    assert scores[method] > scores["fresh"] - 0.05
