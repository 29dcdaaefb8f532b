"""Each seed method in the regime its paper studied, against that paper's own baseline (issue 18, item 5), run
by the grid (`benchmarks/grid.py`: the same data, seeds, workers and results file format):

    python -m benchmarks grid --regime roth   [--quick] [--datasets ...] [--seeds ...]
    python -m benchmarks grid --regime memvir [--quick] [--datasets ...] [--seeds ...]
    python -m benchmarks grid --regime mpn|refine [--quick] [--datasets ...] [--seeds ...]

- `roth` (Roth et al. 2020, seed 003): no memory, the margin loss (beta 1.2, margin 0.2) with
  distance-weighted mining and SPC-2 batches as the baseline (`margin`); each sampler, miner and rho
  (p_switch 0.35, inside the paper's 0.3-0.4) changes one thing of it. The grid's scale (1 + 8 epochs, the lr
  stepped every 3) is kept; the embedding-space metrics are on, so rho_spectrum is reported too.
- `memvir` (Ko et al. 2021, seed 002): NormSoftmax at a constant lr (`normsoftmax`) against the same run
  with MemVir (`memvir`): 1 + 40 epochs for both, MemVir joining after 20 (meant as the baseline's
  convergence, since the paper adds MemVir to a converged model; measured, the baseline's selected epochs were
  22-40, so it was still improving when MemVir joined), M = 10 and N scaled so that the curriculum's N(M+1) steps take
  about 12 epochs (the paper's N = 45 when an epoch has 110 steps or more; see `MemVirConfig`).
- `mpn` (Seidenschwarz et al. 2021, seed 004): the paper's batch for CUB-like sets (6 classes x 9 images;
  glyphs and Omniglot take CUB's setting, `MPN_PAPER_DEFAULTS`), no memory. The baseline (`no_mpn`) is the
  paper's ablation baseline: the same loss, classifiers and batches without message passing
  (`model.mpn.layers=0`); `mpn` trains with the message passing network and reports both the plain backbone
  embedding (what inference serves, `mpn`) and the MPN run at test time over the expanded k-reciprocal
  neighbourhoods (`mpn_test_time`, from the same run); `softmax` (NormSoftmax, a cosine-classifier
  cross-entropy, on the same batches) is a second reference.
- `refine` (seed 001): the refiner with its defaults (T = 8, k = 8, 2 augmented views, 20 epochs, served
  only if it beats plain on validation) on top of the shipped pipeline at the grid's scale. One training per
  seed gives both rows: `plain` (the backbone's embedding) and the refined one (Algorithm 2, both sides
  refined), so the difference is paired by construction. `refined` trains the refiner on views augmented with
  the backbone's recipe (`refine.views_augment=full`), `refined_light` on crop-and-flip views (`light`, the
  default since this regime measured it).

`--quick` shrinks a regime to two methods, one seed, the glyphs and a couple of epochs (under 2 minutes on
the 2-core CPU machine): it checks the machinery, its numbers mean nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROTH_BASE = [
    "memory.method=none", "loss.name=MarginLoss", "loss.params={margin: 0.2, beta: 1.2, nu: 0.0}",
    "loss.miner=DistanceWeightedMiner", "loss.miner_params={cutoff: 0.5, nonzero_loss_cutoff: 1.4}",
    "train.samples_per_class=2", "eval.embedding_space=true",
]
MEMVIR_BASE = [
    "memory.method=none", "loss.name=NormalizedSoftmaxLoss", "loss.params={}", "loss.miner=null",
    "train.lr_gamma=1", "train.warmup_epochs=1", "train.epochs=40",
]
# Intra-Batch's batch (CUB's 6 x 9, which glyphs and Omniglot take): 9 images a class here, 54 from `batches`.
MPN_BASE = ["memory.method=none", "loss.miner=null", "train.samples_per_class=9"]
MEMVIR_WARMUP_EPOCHS = 20
MEMVIR_STEP_GAP = 10
MEMVIR_CURRICULUM_EPOCHS = 12  # epochs over which the virtual steps climb to N
MEMVIR_PAPER_STEPS = 45


@dataclass(frozen=True)
class Regime:
    about: str
    methods: dict[str, list[str]]  # name -> overrides after the grid's data/scale ones
    batches: list[int]
    quick_methods: tuple[str, ...]
    quick: list[str] = field(default_factory=list)  # overrides added to every run under --quick
    # Rows that no job of their own runs: a job of `source` reports them from the same training (name -> source).
    derived: dict[str, str] = field(default_factory=dict)

    def scheduled(self, methods: list[str]) -> list[str]:
        """The jobs that produce `methods`: each derived row asks for its source's job, once."""
        return list(dict.fromkeys(self.derived.get(m, m) for m in methods))

    def overrides(self, method: str, steps_per_epoch: int, quick: bool) -> list[str]:
        extra = memvir_steps(steps_per_epoch, quick) if method == "memvir" else []
        if method == "oracle":  # the memory's turnover: its rows (the training set, or half) over the batch
            rows_per_step = 2 if "memory.size=0.5" in self.methods[method] else 1
            turnover = max(1, steps_per_epoch // rows_per_step)
            extra = [f"memory.oracle_every={-(-turnover // ORACLE_REFRESHES_PER_TURN)}"]
        return [*self.methods[method], *extra, *(self.quick if quick else [])]


def memvir_steps(steps_per_epoch: int, quick: bool) -> list[str]:
    """MemVir's N, M and warm-up: N such that the N(M+1)-step curriculum spans ~MEMVIR_CURRICULUM_EPOCHS."""
    if quick:
        return ["loss.memvir.warmup_epochs=0.5", "loss.memvir.num_steps=2", "loss.memvir.step_gap=1"]
    n = round(MEMVIR_CURRICULUM_EPOCHS * steps_per_epoch / (MEMVIR_STEP_GAP + 1))
    return [f"loss.memvir.warmup_epochs={MEMVIR_WARMUP_EPOCHS}", f"loss.memvir.step_gap={MEMVIR_STEP_GAP}",
            f"loss.memvir.num_steps={min(MEMVIR_PAPER_STEPS, max(1, n))}"]


# Issue 42, is it the regime or the method: the memory's arms with their drift measured every 20 steps. Without
# a star an arm takes the memory loss alone (seed 000's XBN, memory.add_batch_loss=false); with one, the
# minibatch loss is added (XBM*, and the shipped xbn*).
DRIFT_EVERY = ["train.drift_every=20", "train.drift_rows=256"]
MEMORY_ALONE = ["memory.add_batch_loss=false", *DRIFT_EVERY]
# XBM and the oracle as measured before `memory.center_gradient: auto` centred them (issue 52): an arm's name keeps
# its results' meaning; `_c` arms (`--arm`) centre.
UNCENTRED = "memory.center_gradient=false"
DRIFT_ARMS = {
    "none": ["memory.method=none"],
    "xbm": ["memory.method=xbm", UNCENTRED, *MEMORY_ALONE],
    "xbn": ["memory.method=xbn", *MEMORY_ALONE],
    # + memory.oracle_every from the turnover (`overrides`)
    "oracle": ["memory.method=oracle", UNCENTRED, *MEMORY_ALONE],
    "xbn_exclude_self": ["memory.method=xbn", "memory.exclude_self=true", *MEMORY_ALONE],
    "xbn_half": ["memory.method=xbn", "memory.size=0.5", *MEMORY_ALONE],
    # Late: the short schedule has 4 x 32 (batch 64) to 4 x 128 (batch 16) steps after the warm-up, fewer than
    # the 1,000 the issue names, so the memory joins after 2 of the 4 epochs instead (the long regime waits
    # 1,000 steps).
    "xbn_late": ["memory.method=xbn", "memory.start=3", *MEMORY_ALONE],
    "xbm_late": ["memory.method=xbm", "memory.start=3", UNCENTRED, *MEMORY_ALONE],
    "xbn*": ["memory.method=xbn", "memory.add_batch_loss=true", *DRIFT_EVERY],
    "xbm*": ["memory.method=xbm", "memory.add_batch_loss=true", UNCENTRED, *DRIFT_EVERY],
    "xbn_attached": ["memory.method=xbn", "memory.attach_batch=true", *MEMORY_ALONE],
}
# The oracle re-embeds its rows 8 times per turn of the memory: rows at most turnover/8 - 1 steps stale (XBM's
# are turnover/2 on average), at about 2.7x a step's cost.
ORACLE_REFRESHES_PER_TURN = 8
LONG = ["memory.size=0.5", "memory.delay_steps=1000"]


REGIMES: dict[str, Regime] = {
    "roth": Regime(
        about="Roth et al. 2020: margin loss + distance-weighted mining, SPC-2, no memory",
        methods={
            "margin": ROTH_BASE,
            "rho": [*ROTH_BASE, "loss.rho.p_switch=0.35"],
            "spc_r": [*ROTH_BASE, "train.sampler.name=spc_r"],
            "greedy_coreset": [*ROTH_BASE, "train.sampler.name=greedy_coreset"],
            "ddm": [*ROTH_BASE, "train.sampler.name=ddm"],
            "frd": [*ROTH_BASE, "train.sampler.name=frd"],
            "random_miner": [*ROTH_BASE, "loss.miner=RandomTripletMiner", "loss.miner_params={}"],
            "semihard": [*ROTH_BASE, "loss.miner=TripletMarginMiner",
                         "loss.miner_params={type_of_triplets: semihard, margin: 0.2}"],
            "softhard": [*ROTH_BASE, "loss.miner=SoftHardMiner", "loss.miner_params={}"],
        },
        batches=[64],
        quick_methods=("margin", "rho"),
        quick=["train.warmup_epochs=0", "train.epochs=1"],
    ),
    "memvir": Regime(
        about="Ko et al. 2021: NormSoftmax at a constant lr, MemVir joining after 20 of 41 epochs",
        methods={"normsoftmax": MEMVIR_BASE, "memvir": [*MEMVIR_BASE, "loss.memvir.enabled=true"]},
        batches=[64],
        quick_methods=("normsoftmax", "memvir"),
        quick=["train.warmup_epochs=0", "train.epochs=1"],
    ),
    "mpn": Regime(
        about="Seidenschwarz et al. 2021: the Intra-Batch MPN at its paper's batch (6 x 9), no memory",
        methods={"no_mpn": [*MPN_BASE, "model.mpn.enabled=true", "model.mpn.layers=0"],
                 "mpn": [*MPN_BASE, "model.mpn.enabled=true", "model.mpn.test_time=true"],
                 "mpn_test_time": [],
                 "softmax": [*MPN_BASE, "loss.name=NormalizedSoftmaxLoss", "loss.params={}"]},
        batches=[54],
        quick_methods=("no_mpn", "mpn"),
        quick=["train.warmup_epochs=0", "train.epochs=1"],
        derived={"mpn_test_time": "mpn"},
    ),
    "drift": Regime(
        about="issue 42: the memory's arms in the grid's short schedule, drift measured every 20 steps",
        methods=DRIFT_ARMS,
        batches=[16, 64],
        quick_methods=("xbn", "oracle"),
        quick=["train.warmup_epochs=0", "train.epochs=1", "train.drift_every=2"],
    ),
    "drift_long": Regime(
        about="issue 42, seed 000's Table 2 setting scaled: batch 64, memory 50% joining 1,000 steps after the "
              "warm-up, turning over 30 times",
        methods={m: [*DRIFT_ARMS[m], *LONG] if m != "none" else DRIFT_ARMS[m]
                 for m in ("none", "xbn", "oracle", "xbn_exclude_self", "xbn*")},
        batches=[64],
        quick_methods=("xbn", "oracle"),
        quick=["train.warmup_epochs=0", "train.epochs=1", "memory.delay_steps=0", "train.drift_every=2"],
    ),
    "refine": Regime(
        about="seed 001: the neighbourhood cross-attention refiner with its defaults on the shipped pipeline",
        methods={"plain": [], "refined": ["refine.enabled=true", "refine.views_augment=full"],
                 "refined_light": ["refine.enabled=true", "refine.views_augment=light"]},
        batches=[64],
        quick_methods=("plain", "refined"),
        quick=["train.warmup_epochs=0", "train.epochs=1", "refine.epochs=1"],
        derived={"plain": "refined"},
    ),
}
