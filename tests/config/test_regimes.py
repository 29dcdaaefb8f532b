"""benchmarks/regimes.py: each seed method's paper regime loads as valid params (the config checks that MemVir
and Roth's methods impose pass), and says what the papers say: Roth's methods run without a memory on the
margin loss with distance-weighted mining and p_switch in 0.3-0.4; MemVir and its NormSoftmax baseline share
one constant-lr schedule, MemVir joining after the baseline's warm-up, with N scaled to the epoch's steps."""

from __future__ import annotations

import sys

import pytest
from tests_support import ROOT

from xbn.config import load_params

sys.path.insert(0, str(ROOT))
from benchmarks.grid import SCALE
from benchmarks.regimes import REGIMES, memvir_steps

GRID_SCALE = [f"train.epochs={SCALE['epochs']}", f"train.warmup_epochs={SCALE['warmup_epochs']}",
              f"train.lr_step_epochs={SCALE['lr_step_epochs']}"]


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize(("regime", "method"), [(r, m) for r, reg in REGIMES.items() for m in reg.methods
                                                if m not in reg.derived])  # a derived row has no run of its own
def test_every_regime_run_loads_as_valid_params(regime, method, quick):
    batch = f"train.batch_size={REGIMES[regime].batches[0]}"  # the grid sets the regime's batch
    params = load_params(ROOT / "params.yaml", [*GRID_SCALE, batch, *REGIMES[regime].overrides(method, 9, quick)])
    if regime == "refine":  # the refiner on top of the shipped pipeline, T = 8 blocks and k = 8 (the paper's)
        shipped = load_params(ROOT / "params.yaml").memory
        assert params.memory == shipped and (params.refine.blocks, params.refine.k) == (8, 8)
        assert params.refine.enabled == (method != "plain")
        if method != "plain":
            assert params.refine.views_augment == ("light" if method == "refined_light" else "full")
        return
    if regime.startswith("drift"):  # issue 42's arms: memory loss alone unless starred, drift measured
        m = params.memory
        assert m.method == method.split("_")[0].rstrip("*")
        if method != "none":
            assert m.add_batch_loss == method.endswith("*") and params.train.drift_every == (2 if quick else 20)
            assert m.exclude_self == ("exclude_self" in method) and m.attach_batch == ("attached" in method)
        if method == "oracle":  # 8 refreshes per turn of the memory: 9 steps an epoch, a full or half memory
            assert m.oracle_every == (1 if regime == "drift_long" else 2)
        if regime == "drift_long" and method != "none":
            assert (m.size, m.delay_steps) == (0.5, 0 if quick else 1000)
        return
    assert params.memory.method == "none"
    if regime == "mpn":  # the paper's 6 x 9 batch (CUB's, which glyphs take), with and without message passing
        assert (params.train.batch_size, params.train.samples_per_class) == (54, 9)
        mpn = params.model.mpn.resolved(params.data.dataset)
        assert (mpn.enabled, mpn.layers) == {"no_mpn": (True, 0), "softmax": (False, 1)}.get(method, (True, 1))
        return
    if regime == "roth":
        assert params.loss.name == "MarginLoss" and params.train.samples_per_class == 2
        assert params.eval.embedding_space  # rho_spectrum is reported
        if method == "rho":
            assert 0.3 <= params.loss.rho.p_switch <= 0.4
        if method not in ("random_miner", "semihard", "softhard"):
            assert params.loss.miner == "DistanceWeightedMiner"
    else:  # the baseline and MemVir: the same constant-lr schedule, MemVir the only difference
        assert params.train.lr_gamma == 1 and params.loss.name == "NormalizedSoftmaxLoss"
        assert params.loss.memvir.enabled == (method == "memvir")
        assert (params.train.epochs, params.train.warmup_epochs) == ((1, 0) if quick else (40, 1))


def test_memvir_curriculum_spans_about_twelve_epochs_up_to_the_papers_n():
    # 9 steps an epoch (the grid's glyphs at batch 64): N = round(12 x 9 / 11) = 10, the curriculum's
    # N (M + 1) = 110 steps = 12.2 epochs; 110 steps an epoch or more: the paper's N = 45, M = 10.
    assert memvir_steps(9, quick=False) == ["loss.memvir.warmup_epochs=20", "loss.memvir.step_gap=10",
                                            "loss.memvir.num_steps=10"]
    assert memvir_steps(200, quick=False)[-1] == "loss.memvir.num_steps=45"
