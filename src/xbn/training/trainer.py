"""The training loop (seed 000's recipe): a pre-warm-up of the new head with the backbone frozen, then the whole
network with AdamW and a step schedule; the loss is taken against the drift-corrected memory.

Every epoch ends with a validation score on the class-disjoint `val` split (never the test split), the best
model in `models/model.pt` and a resumable checkpoint in `models/last.pt`, both written atomically. Randomness is
re-seeded from (seed, epoch) at the start of every epoch, so a run resumed from an epoch boundary continues
exactly as the uninterrupted run would have.

Data-parallel (`xbn train --nproc N`, which runs `python -m xbn.cli train` under torchrun): every rank draws the same global batch and
loads its contiguous slice (`batches.RankBatchSampler`), each sample augmented from its own seed as in one
process; the model is wrapped in DistributedDataParallel and the criterion gathers the global batch, so the
loss, the memory and the gradient equal the single-process run's. BatchNorm is frozen by default
(`model.freeze_bn`), so batch statistics never enter and no SyncBatchNorm is needed. Validation, checkpoints,
metrics files and the epoch callback (tracking) happen on rank 0; its validation scores are broadcast, so
every rank takes the same best-model decision, and the others wait at a barrier while rank 0 writes. After
every epoch the ranks compare fingerprints of their weights and memory (`replicas`, in metrics/train.json).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm import tqdm

from xbn.config import ConfigError, Params, flatten
from xbn.data import DatasetError, ImageDataset, build_transform, encode_labels, read_manifest
from xbn.data.cache import CachedImageDataset, DecodedImages
from xbn.data.cache import prepare as prepare_cache
from xbn.data.dataset import collate_skipping, loader_worker_init
from xbn.data.loading import QUEUED_BATCHES, loader_options, resolve_num_workers
from xbn.data.samplers import build_batch_sampler
from xbn.data.snapshot import current_record
from xbn.evaluation.embed import autocast, evaluate_split, image_loader
from xbn.evaluation.embed import embed as embed_images
from xbn.evaluation.inference import InferenceMode
from xbn.models import InitialWeights, build_embedder, save_embedder
from xbn.models.mpn import save_mpn
from xbn.training.batches import RankBatchSampler, RequestedBatches, SeededSamples
from xbn.training.criterion import Criterion, build_criterion
from xbn.training.diagnostics import MEMORY_DRIFT_COLUMNS, FeatureDrift, memory_drift, summarize_memory_drift
from xbn.training.figures import FIGURE_COLUMNS
from xbn.training.memory_format import choose_channels_last
from xbn.training.prefetch import DeviceBatches
from xbn.training.replicas import compare_replicas
from xbn.utils import distributed
from xbn.utils.errors import NonFiniteLossError, TrainingStalledError
from xbn.utils.io import save_torch, write_csv, write_json
from xbn.utils.runtime import resolve_device, seed_everything
from xbn.utils.secrets import mask_values

log = logging.getLogger(__name__)

EpochCallback = Callable[[int, dict], None]

# Fixed columns so the DVC plots find them whatever the memory method (empty where it does not apply).
STEP_COLUMNS = ["iteration", "epoch", "loss", "lr", "drift_mean", "drift_max", "gain", "memory_mean", "memory_std",
                "batch_mean", "batch_std", "scale", *FIGURE_COLUMNS, *MEMORY_DRIFT_COLUMNS]


class CheckpointMismatchError(ConfigError):
    """`models/last.pt` was written with other training params: resuming it would splice two different runs."""


CHECKPOINT_FORMAT = "xbn-train-state/1"
# What a resumed run must share with its checkpoint: the sections the train stage depends on (dvc.yaml), except
# the keys that cannot change the weights: where outputs go, how many loader processes read the images, and
# train.epochs (a resumed run may go further: the schedule steps every lr_step_epochs, whatever the total).
TRAINING_SECTIONS = ("data.", "model.", "memory.", "loss.", "train.")
MAY_DIFFER_ON_RESUME = {"data.num_workers", "train.checkpoint_dir", "train.metrics_dir", "train.epochs"}


def params_record(params: Params) -> dict:
    """The flattened params as plain JSON values (what a checkpoint stores: `torch.load(weights_only=True)`
    reads it back)."""
    return mask_values(json.loads(json.dumps(flatten(params), sort_keys=True, default=str)))


def params_hash(params: Params) -> str:
    """The value `xbn.tracking.fingerprints.params_hash` tags MLflow runs with, computed here because importing
    xbn.tracking loads MLflow, which training never does."""
    return hashlib.sha256(json.dumps(flatten(params), sort_keys=True, default=str).encode()).hexdigest()


def training_params_differ(saved: dict, current: dict) -> list[str]:
    """The keys of the training sections whose values differ between two `params_record`s (sorted)."""
    keys = {k for k in saved.keys() | current.keys() if k.startswith(TRAINING_SECTIONS)} - MAY_DIFFER_ON_RESUME
    missing = object()
    return sorted(k for k in keys if saved.get(k, missing) != current.get(k, missing))


def checkpoint_identity(path: str | Path) -> dict | None:
    """Who wrote the training checkpoint at `path`: its params hash, the flow run it belongs to (None outside
    one, or when written before xbn recorded it) and the epochs it completed; None when there is no file."""
    path = Path(path)
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {"params_hash": state.get("params_hash"), "flow_run_id": state.get("flow_run_id"),
            "epoch": int(state.get("epoch", 0))}


@dataclass
class History:
    """What the run has logged so far; stored in the resumable checkpoint."""

    steps: list[dict] = field(default_factory=list)
    epochs: list[dict] = field(default_factory=list)
    best_score: float = -math.inf
    best_epoch: int = -1
    skipped: list[str] = field(default_factory=list)  # unreadable training images, skipped (paths)
    warnings: list[str] = field(default_factory=list)  # training that learns nothing (`train.stall`), by cause


class Trainer:
    """`flow_run_id`: the retrain flow run this training belongs to (recorded in `last.pt`, so that a retry of
    the flow resumes only its own checkpoint); None outside a flow run."""

    def __init__(self, params: Params, progress: bool = True, on_epoch: EpochCallback | None = None,
                 flow_run_id: str | None = None, init: InitialWeights | None = None):
        self.params, self.progress, self.on_epoch = params, progress, on_epoch
        self.flow_run_id = None if flow_run_id is None else str(flow_run_id)
        p = params
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self.is_main = self.rank == 0
        self.device = resolve_device(p.train.device)
        self.amp = p.train.amp and self.device.type == "cuda"
        self.checkpoint_dir = Path(p.train.checkpoint_dir)
        self.metrics_dir = Path(p.train.metrics_dir)

        seed_everything(p.train.seed)
        self.manifest = read_manifest(p.data.manifest)
        train_frame = self.manifest[self.manifest["split"] == "train"]
        if train_frame.empty:
            raise ValueError(f"{p.data.manifest} has no 'train' rows")
        # The training classes as 0..C-1 (sorted, as over the whole manifest): classification/proxy losses
        # index their class weights by label.
        train_labels = encode_labels(train_frame["label"])

        self.model, self.data_config = build_embedder(p.model)
        # Where the weights started, recorded in model.pt (a resumed run reads it back from last.pt).
        self.init_record = init.record() if init else None
        if init is not None:  # a fine-tuning: trained weights replace model.pretrained's
            init.load_into(self.model, p.model)
        if self.world_size > 1 and not p.model.freeze_bn:
            if self.device.type == "cuda":  # batch statistics over the global batch, as in one process
                self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
            else:  # SyncBatchNorm runs on GPUs only
                log.warning("model.freeze_bn=false on %d CPU processes: each rank's BatchNorm sees only "
                            "its slice of the batch, unlike a single-process run", self.world_size)
        self.model.to(self.device)
        # Every rank takes rank 0's choice: one memory format across the process group.
        self.channels_last, self.memory_format = distributed.broadcast_from_main(
            choose_channels_last(p.train.channels_last, self.model, self.device, p.train.batch_size,
                                 p.data.image_size, self.amp) if self.is_main else None)
        if self.is_main and p.train.channels_last == "auto":
            log.info("train.channels_last=auto: %s (%s)", self.channels_last, ", ".join(
                f"{k} {v}" for k, v in self.memory_format.items() if k.startswith("probe_")))
        if self.channels_last:
            self.model.to(memory_format=torch.channels_last)
        mean, std = self.data_config["mean"], self.data_config["std"]
        self.eval_transform = build_transform(p.data.image_size, training=False, mean=mean, std=std)
        # An image that became unreadable after `validate` is skipped and counted, not fatal; not under DDP,
        # where a rank's smaller slice would break the gather of the global batch: there it still raises.
        self.num_workers = resolve_num_workers(p.data.num_workers)
        train_set = self._training_images(train_frame, train_labels, mean, std)
        self.train_paths = train_set.paths
        _check_enough_classes(train_frame, p.data.manifest)
        # train.batch_size is the global batch; each rank loads its slice of it.
        batches = build_batch_sampler(p.train.sampler, train_labels, p.train.batch_size,
                                      p.train.samples_per_class, seed=p.train.seed)
        if hasattr(batches, "observe") and self.world_size > 1:
            # Every rank must draw the same global batch, hence hold the same bank bit for bit: not supported.
            raise ValueError(f"train.sampler.name={p.train.sampler.name} (an embedded sampler) runs in one "
                             f"process only; use spc_n or spc_r with {self.world_size} processes")
        self.batches = batches
        self._bank_source = (train_frame, train_labels)  # embedded samplers: the initial embedding pass
        self.sampler = RankBatchSampler(batches, self.rank, self.world_size, seed=p.train.seed)
        self.loader_generator = torch.Generator()
        self.requested = RequestedBatches(self.sampler)  # names the rows a batch lost
        # Persistent workers: no start-up per epoch (each sample is seeded by itself, not by its worker). An
        # embedded sampler's batches are chosen from a bank that every step refreshes: torch's 2 queued batches
        # per worker, no deeper, so that they are not chosen from an older bank.
        queued = None if hasattr(batches, "observe") else QUEUED_BATCHES
        self.loader = DataLoader(SeededSamples(train_set), batch_sampler=self.requested,
                                 collate_fn=getattr(train_set, "collate", collate_skipping),
                                 worker_init_fn=loader_worker_init,
                                 generator=self.loader_generator,
                                 **loader_options(self.num_workers, self.device.type, queued_batches=queued))
        probe_set = ImageDataset(train_frame, p.data.root, train_labels, self.eval_transform,
                                 skip_unreadable=True)
        probe_idx = np.linspace(0, len(probe_set) - 1, min(p.train.probe_size, len(probe_set))).astype(int)
        probes = [probe_set[int(i)] for i in probe_idx]
        self.probe = torch.stack([s[0] for s in probes if s is not None])
        self.drift = FeatureDrift()
        self.history = History()
        if unreadable := [int(i) for i, s in zip(probe_idx, probes) if s is None]:
            paths = [probe_set.paths[i] for i in unreadable]
            log.warning("drift probe (train.probe_size): %d unreadable image(s) left out, manifest row(s) %s: %s",
                        len(paths), ", ".join(str(probe_set.rows[i]) for i in unreadable), ", ".join(paths))
            self.history.skipped = sorted(set(paths))  # counted in the summary's skipped_images

        self.criterion: Criterion = build_criterion(p, len(train_set), train_labels,
                                                     steps_per_epoch=len(self.sampler)).to(self.device)
        self.stored_inputs = self._track_memory_inputs()
        self.has_val = (self.manifest["split"] == "val").any()
        self.epoch = 0  # epochs completed
        self.iteration = 0
        self.throughput = 0.0  # training images per second of the last epoch
        self.replicas: dict | None = None  # the ranks' fingerprints after the last epoch (`compare_replicas`)
        self.net: nn.Module = self.model  # what the training step calls: the model or its DDP wrapper
        self.window_steps = self.window_zero_loss = 0  # `train.stall`'s window of steps
        self.optimizer, self.scheduler = self._optimizer_for(0)

    def _training_images(self, frame, labels, mean, std):
        """The training set: read through the decode cache (`data.cache`, `xbn.data.cache`) or with PIL and
        timm's transform. Rank 0 builds the cache; the other ranks wait for it and open the same file."""
        p = self.params
        skip = self.world_size == 1
        images = ImageDataset(frame, p.data.root, labels,
                              build_transform(p.data.image_size, training=True, mean=mean, std=std),
                              skip_unreadable=skip)
        self.device_augment = None
        self.data_pipeline: dict = {"num_workers": self.num_workers, "augment_on": "loader"}
        if p.data.cache is False:
            self.data_pipeline["cache"] = {"path": None, "reason": "data.cache=false"}
            return images
        record = None
        if self.is_main:
            found = current_record(p) if p.data.version == "dvc" else None
            record = prepare_cache(images, p.data.image_size, p.data.cache, p.data.cache_max_gb,
                                   found.md5 if found is not None else None, threads=max(1, self.num_workers + 1))
        record = distributed.broadcast_from_main(record)
        self.data_pipeline["cache"] = record
        if record["path"] is None:
            return images
        on_device = p.data.augment_on == "device" or (p.data.augment_on == "auto" and self.device.type == "cuda")
        self.data_pipeline["augment_on"] = "device" if on_device else "loader"
        cached = CachedImageDataset(DecodedImages(record["path"], record["key"]), images, p.data.image_size, mean,
                                    std, mode="train_device" if on_device else "train", skip_unreadable=skip)
        if on_device:
            self.device_augment = cached.augment
        if self.is_main:
            log.info("training images: decode cache %s (%s; keyed on %s), batch augmentation on the %s, %d "
                     "loader workers", record["path"], record["reason"], record["keyed_on"],
                     self.data_pipeline["augment_on"], self.num_workers)
        return cached

    def _track_memory_inputs(self):
        """The memory slots whose inputs are kept (issue 42): all of them for the oracle, a fixed sample of
        `train.drift_rows` for the drift measurement (off under data parallelism: a rank sees its slice of
        the batch only), none without a memory."""
        memory, p = self.criterion.memory, self.params
        if memory is None:
            return None
        if p.memory.method == "oracle":
            if self.world_size > 1:
                raise ConfigError("memory.method=oracle (a diagnostic) runs in one process only")
            slots = torch.arange(memory.memory_size)
        elif p.train.drift_every and self.world_size == 1:
            slots = torch.linspace(0, memory.memory_size - 1, min(p.train.drift_rows, memory.memory_size)).long()
        else:
            return None
        return memory.track_inputs(slots, self.data_config["mean"], self.data_config["std"])

    @torch.no_grad()
    def _embed_stored(self, images: torch.Tensor) -> torch.Tensor:
        """The current model's embedding of stored memory inputs: no gradient, eval mode (BatchNorm as training
        has it with model.freeze_bn), the training's memory format and autocast."""
        images = images.to(self.device)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        was_training = self.model.training
        self.model.eval()
        try:
            with autocast(self.device, self.amp):
                return self.model(images).float()
        finally:
            self.model.train(was_training)

    # -- phases ---------------------------------------------------------------------------------------------
    def _in_warmup(self, epoch: int) -> bool:
        return epoch < self.params.train.warmup_epochs

    def _optimizer_for(self, epoch: int):
        t = self.params.train
        if self._in_warmup(epoch):
            self.model.set_backbone_trainable(False)
            self._wrap()
            groups = [{"params": list(self.model.head_parameters())}, *self._criterion_groups(t.warmup_lr)]
            return self._sync_criterion(torch.optim.SGD(groups, lr=t.warmup_lr, momentum=0.9)), None
        self.model.set_backbone_trainable(True)
        self._wrap()
        groups = [{"params": list(self.model.parameters())}, *self._criterion_groups(t.lr)]
        optimizer = self._sync_criterion(torch.optim.AdamW(groups, lr=t.lr, weight_decay=t.weight_decay))
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, t.lr_step_epochs, t.lr_gamma)

    def _criterion_groups(self, lr: float) -> list[dict]:
        """The loss side's trainable parameters (e.g. the Intra-Batch MPN and its classifiers) as their own
        param group, trained in both phases (kept equal across ranks by `_sync_criterion`)."""
        # The loss's class weights/proxies (e.g. NormalizedSoftmaxLoss.W) at loss.lr_multiplier x lr.
        own = [q for q in self.criterion.loss.parameters() if q.requires_grad]
        rest = [q for q in self.criterion.parameters() if q.requires_grad and id(q) not in set(map(id, own))]
        groups = [{"params": own, "lr": lr * self.params.loss.lr_multiplier}] if own else []
        return groups + ([{"params": rest}] if rest else [])

    def _sync_criterion(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Under DDP, average the criterion's gradients over the ranks before every step. DDP reduces only the
        wrapped model's; each rank computes the criterion on the same gathered global batch, but with its own
        dropout masks (the MPN's), so unreduced its weights would drift apart from rank to rank."""
        params = [q for q in self.criterion.parameters() if q.requires_grad]
        if self.world_size > 1 and params:
            optimizer.register_step_pre_hook(lambda *_: distributed.average_gradients(params))
        return optimizer

    def _wrap(self) -> None:
        """(Re)wrap the model in DDP after its trainable set changed: DDP reduces the gradients of exactly
        the parameters that required grad when it was built, so the warm-up's wrapper would drop the
        backbone's."""
        if self.world_size == 1:
            return
        # The old wrapper's gradient hooks go with it (and act only after their own wrapper's forward anyway).
        self.net = self.model
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.net = DistributedDataParallel(self.model, device_ids=ids)

    @property
    def total_epochs(self) -> int:
        return self.params.train.warmup_epochs + self.params.train.epochs

    # -- checkpoints ----------------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            # Whose checkpoint this is: `resume` refuses other params, the retrain flow another flow run's.
            "params_hash": params_hash(self.params),
            "params": params_record(self.params),
            "flow_run_id": self.flow_run_id,
            "init": self.init_record,
            "memory_format": self.memory_format,  # a resumed run keeps the format it started in
            "epoch": self.epoch,
            "iteration": self.iteration,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "criterion": self.criterion.state_dict(),
            "drift": self.drift.state_dict(),
            "sampler": self.batches.state_dict() if hasattr(self.batches, "state_dict") else None,
            "history": {"steps": self.history.steps, "epochs": self.history.epochs,
                        "best_score": self.history.best_score, "best_epoch": self.history.best_epoch,
                        "skipped": self.history.skipped, "warnings": self.history.warnings},
        }

    def resume(self, path: str | Path | None = None) -> bool:
        """Load `models/last.pt` if it exists; returns whether training resumed. A checkpoint written with other
        training params raises `CheckpointMismatchError` (a ConfigError) naming the keys that differ."""
        path = Path(path or self.checkpoint_dir / "last.pt")
        if not path.exists():
            log.warning("no checkpoint at %s: starting from scratch", path)
            return False
        state = torch.load(path, map_location=self.device, weights_only=True)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not an xbn training checkpoint")
        self._check_params(path, state)
        self.epoch, self.iteration = int(state["epoch"]), int(state["iteration"])
        self.model.load_state_dict(state["model"])
        self.optimizer, self.scheduler = self._optimizer_for(self.epoch)
        # Crossing from warm-up into the main phase starts a fresh optimizer; otherwise restore its state.
        if self._in_warmup(self.epoch) == self._in_warmup(self.epoch - 1):
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scheduler and state["scheduler"]:
                self.scheduler.load_state_dict(state["scheduler"])
        self.criterion.load_state_dict(state["criterion"])
        self.init_record = state.get("init")
        if (saved := state.get("memory_format")) and saved["channels_last"] != self.channels_last:
            # auto's probe may choose otherwise this time: continue in the format the run trained in.
            self.channels_last, self.memory_format = saved["channels_last"], saved
            fmt = torch.channels_last if self.channels_last else torch.contiguous_format
            self.model.to(memory_format=fmt)
        self.drift.load_state_dict(state["drift"])
        if state.get("sampler") is not None and hasattr(self.batches, "load_state_dict"):
            self.batches.load_state_dict(state["sampler"])  # the embedded samplers' bank
        h = state["history"]
        self.history = History(h["steps"], h["epochs"], float(h["best_score"]), int(h["best_epoch"]),
                               sorted(set(h.get("skipped", [])) | set(self.history.skipped)),
                               list(h.get("warnings", [])))
        log.info("resumed from %s at epoch %d (iteration %d)", path, self.epoch, self.iteration)
        if self.epoch > self.total_epochs:
            t = self.params.train
            log.warning(
                "%s has already completed %d epochs, past the %d this run asks for (train.epochs=%d + "
                "train.warmup_epochs=%d): nothing is trained, and %s (best epoch %d) is kept as it is; set "
                "train.epochs to at least %d to train further", path, self.epoch, self.total_epochs, t.epochs,
                t.warmup_epochs, self.checkpoint_dir / "model.pt", self.history.best_epoch,
                self.epoch - t.warmup_epochs + 1)
        elif self.epoch == self.total_epochs:
            log.info("%s has completed all %d epochs: nothing left to train", path, self.epoch)
        return True

    def _check_params(self, path: Path, state: dict) -> None:
        if state.get("params_hash") == params_hash(self.params):
            return
        saved = state.get("params")
        if saved is None:
            raise CheckpointMismatchError(
                f"{path} does not record the params it was trained with (written by an older xbn), so resuming "
                f"it could continue another run: train without --resume, or delete it")
        current = params_record(self.params)
        differ = training_params_differ(saved, current)
        if differ:
            shown = "; ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {current.get(k)!r} now" for k in differ[:8])
            more = f" (and {len(differ) - 8} more)" if len(differ) > 8 else ""
            raise CheckpointMismatchError(
                f"{path} was trained with other params: {len(differ)} key(s) differ: {shown}{more}. Resume with "
                f"the checkpoint's params, or train without --resume (it overwrites {path.name})")
        changed = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
        log.info("%s: resuming; only keys that leave the weights as they are differ: %s", path, ", ".join(changed))

    # -- the loop -------------------------------------------------------------------------------------------
    def validate(self) -> dict:
        if not self.has_val:
            return {}
        p = self.params
        metrics = evaluate_split(
            self.model, self.manifest, p.data.root, "val", image_size=p.data.image_size,
            mean=self.data_config["mean"], std=self.data_config["std"], ks=(1, 2, 4, 8),
            batch_size=p.eval.batch_size, num_workers=p.data.num_workers, device=self.device,
            mode=self.inference_mode, nmi=False)
        return {f"val_{k}": float(v) for k, v in metrics.items() if k in ("recall@1", "recall@2", "recall@4", "map@r")}

    def _validate_on_main(self) -> dict:
        # Rank 0 validates; every rank gets its scores, so all take the same best-model decision.
        return distributed.broadcast_from_main(self.validate() if self.is_main else None)

    def fit(self) -> dict:
        start = time.perf_counter()
        if self.epoch == 0 and self.params.train.init != "pretrained" and self.init_record is None:
            raise ValueError(f"train.init={self.params.train.init}: the weights to start from were not resolved "
                             "(the train stage resolves them: `xbn train`, or pass `init=` to fit)")
        if self.epoch == 0 and not self.history.epochs:
            initial = self._validate_on_main()
            self.history.epochs.append({"epoch": 0, "loss": float("nan"), **initial})
        while self.epoch < self.total_epochs:
            if self._in_warmup(self.epoch) != self._in_warmup(self.epoch - 1) and self.epoch > 0:
                self.optimizer, self.scheduler = self._optimizer_for(self.epoch)
            loss = self._train_epoch()
            lr = self.optimizer.param_groups[0]["lr"]  # the epoch's, before the schedule steps
            self.epoch += 1
            if self.scheduler:
                self.scheduler.step()
            row = {"epoch": self.epoch, "loss": loss, **self._validate_on_main()}
            self.history.epochs.append(row)
            if self.is_main:
                val = f", val R@1 {row['val_recall@1']:.4f}" if "val_recall@1" in row else ""
                log.info("epoch %d/%d: loss %.4f, lr %.2g, %.0f images/s%s", self.epoch, self.total_epochs, loss, lr,
                         self.throughput, val)
            self._watch_validation()
            score = row.get("val_recall@1", self.epoch)  # no val split: the last epoch is kept
            best = score > self.history.best_score
            if best:
                self.history.best_score, self.history.best_epoch = score, self.epoch
            self.replicas = compare_replicas(self.model, self.criterion.memory)
            if self.is_main:
                if best:
                    save_embedder(self.checkpoint_dir / "model.pt", self.model, self.params.model,
                                  self.data_config, {"epoch": self.epoch, "metrics": row, **self._provenance()})
                    self._save_mpn()
                save_torch(self.checkpoint_dir / "last.pt", self._state())
                self._write_metrics(time.perf_counter() - start)
                if self.on_epoch:
                    self.on_epoch(self.epoch, row)
            distributed.barrier()  # no rank runs ahead (or reads last.pt) before rank 0 has written it
        # Zero epochs: the untrained model is the model.
        if self.is_main and not (self.checkpoint_dir / "model.pt").exists():
            save_embedder(self.checkpoint_dir / "model.pt", self.model, self.params.model, self.data_config,
                          {"epoch": 0, "metrics": self.history.epochs[-1] if self.history.epochs else {},
                           **self._provenance()})
            self._save_mpn()
            self._write_metrics(time.perf_counter() - start)
        distributed.barrier()
        return self.summary()

    # -- training that learns nothing (`train.stall`) ------------------------------------------------------
    def _watch_steps(self, loss: float) -> None:
        """At the end of each window of `train.stall.window` steps: a loss of exactly 0 on every step, or a
        miner that found no pair (or no positive) on every step, is said, naming the cause."""
        self.window_steps += 1
        self.window_zero_loss += loss == 0.0
        stall = self.params.train.stall
        if self.window_steps < stall.window:
            return
        n, mining = self.window_steps, self.criterion.take_mining()
        zero_loss = self.window_zero_loss == n
        self.window_steps = self.window_zero_loss = 0
        margins = self.params.loss.miner_params
        if mining["steps"] == n and mining["no_pair"] == n:
            self._stalled("no_pair", f"the miner found no pair in {n} steps: the batch is too easy; try a memory "
                          f"(memory.method), a larger batch (train.batch_size) or a lower neg_margin "
                          f"(loss.miner_params.neg_margin={margins.get('neg_margin')})", stop=zero_loss)
        elif mining["steps"] == n and mining["no_positive"] == n:
            self._stalled("no_positive", self._no_positive_text(n, "", mining), stop=zero_loss)
        if zero_loss:
            self._stalled("zero_loss", f"the loss was exactly 0 for {n} steps: no gradient, the model does not "
                          f"learn; try a memory (memory.method), a larger batch or another miner (loss.miner)")
        # The memory path (issue 52): its loss may sit at 0 while the minibatch loss beside it does not.
        memory_zero = mining.get("memory_zero_loss", 0) == n
        if mining.get("memory_steps", 0) == n and mining["memory_no_positive"] == n:
            self._stalled("memory_no_positive", self._no_positive_text(n, " against the memory", mining, "memory_"),
                          stop=memory_zero)
        if memory_zero:
            self._stalled("memory_zero_loss", f"the memory loss was exactly 0 for {n} steps: the memory gives no "
                          f"gradient; see memory_positives and batch_cosine in {self.metrics_dir / 'train_steps.csv'}"
                          f" (loss.no_positive={self.params.loss.no_positive})")

    def _no_positive_text(self, n: int, where: str, mining: dict[str, int], prefix: str = "") -> str:
        margins = self.params.loss.miner_params
        fallback = (f"; the loss was taken over all pairs instead ({mining[prefix + 'all_pairs']} of them)"
                    if mining[prefix + "all_pairs"] else "")
        return (f"the miner found no positive pair{where} in {n} steps, only negatives: every positive pair is "
                f"closer than loss.miner_params.pos_margin={margins.get('pos_margin')}, so the embeddings have "
                f"collapsed{fallback}; try a memory (memory.method), a lower train.lr or loss.miner=null")

    def _watch_validation(self) -> None:
        """Val R@1 below the warm-up's (the untrained model's without a warm-up) for `patience` epochs in a
        row after it: training is making the model worse."""
        warmup, patience = self.params.train.warmup_epochs, self.params.train.stall.patience
        scores = {e["epoch"]: e.get("val_recall@1") for e in self.history.epochs}
        reference = scores.get(warmup)
        after = [scores.get(e) for e in range(warmup + 1, self.epoch + 1)][-patience:]
        if reference is None or len(after) < patience or any(v is None or v >= reference for v in after):
            return
        self._stalled("val_below_warmup", f"val R@1 has stayed below the warm-up's ({reference:.4f}) for "
                      f"{patience} epochs after it (now {after[-1]:.4f}): training makes the model worse; see "
                      f"{self.metrics_dir / 'train_epochs.csv'}")

    def _stalled(self, kind: str, message: str, stop: bool = True) -> None:
        """Warn once per cause (kept in metrics/train.json), and stop when train.stall.action says so."""
        text = f"epoch {self.epoch + 1}: {message}"
        if not any(w.split(": ", 1)[-1] == message or f"[{kind}]" in w for w in self.history.warnings):
            self.history.warnings.append(f"[{kind}] {text}")
            if self.is_main:
                log.warning("%s", text)
        if stop and self.params.train.stall.action == "stop":
            if self.is_main:
                self._write_metrics(0.0)
            raise TrainingStalledError(f"{text} (train.stall.action=stop; the last checkpoints are kept)")

    def _provenance(self) -> dict:
        """What the registry reads back from model.pt: the params it was trained with (resolved) and their
        hash, so a version's record never depends on the params of the later `register` call."""
        # Nested (lossless), every password in a URI masked: a checkpoint travels with the registered version.
        return {"params": mask_values(self.params.model_dump(mode="json")),
                "params_hash": params_hash(self.params),
                # Where the weights started (a fine-tuning): the registry's parent_version comes from here.
                **({"init": self.init_record} if self.init_record else {})}

    def _save_mpn(self) -> None:
        # The Intra-Batch MPN of the selected epoch, for evaluate's test-time option ('disabled' marker if none).
        mpn_loss = self.criterion.mpn_loss
        save_mpn(self.checkpoint_dir / "mpn.pt", mpn_loss.mpn if mpn_loss is not None else None)

    def _train_epoch(self) -> float:
        p = self.params.train
        epoch_seed = p.seed * 100_003 + self.epoch
        if hasattr(self.batches, "observe") and not self.batches.ready:
            self._fill_bank()  # before the reseeding below: its DataLoader draws from the global RNG
        # Distinct per rank, rank 0's being the single-process seed: a stochastic layer then draws independent
        # masks on each rank's slice instead of repeating rank 0's.
        seed_everything(epoch_seed * self.world_size + self.rank)
        self.loader_generator.manual_seed(epoch_seed)
        self.sampler.set_epoch(self.epoch)
        self.net.train()
        losses, seen, started = [], 0, time.perf_counter()
        # A bar on a terminal; under dvc repro or a scheduler (no terminal) the epoch's log line says it all.
        bar = tqdm(self.epoch_batches(), desc=f"epoch {self.epoch + 1}/{self.total_epochs}", leave=False,
                   disable=not (self.progress and self.is_main and sys.stderr.isatty()), mininterval=1)
        for images, labels, indices in bar:
            if missing := self.requested.missing(indices):
                self._record_skipped(missing)
                if not len(labels):
                    continue
            loss, embeddings = self.step(images, labels, indices)
            if hasattr(self.batches, "observe"):  # embedded samplers: refresh the bank with this batch
                self.batches.observe(indices, embeddings.detach())
            self.iteration += 1
            seen += len(labels)
            losses.append(loss)
            self._watch_steps(loss)
            if self.iteration % p.log_every == 0:
                self.criterion.check_finite()
            if self.is_main and (self.iteration % p.log_every == 0 or self._memory_drift_due()):
                self._log_step(losses[-1])
            bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{self.optimizer.param_groups[0]['lr']:.2g}",
                            img_s=f"{seen / (time.perf_counter() - started):.0f}")
        self.throughput = seen / max(time.perf_counter() - started, 1e-9)
        self.criterion.check_finite()  # before the epoch's checkpoint is written
        return float(np.mean(losses)) if losses else float("nan")

    def step(self, images: torch.Tensor, labels: torch.Tensor,
             indices: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
        """One optimisation step on a batch (the benchmarks time exactly this); returns the loss and the
        embeddings. A non-finite loss stops before the update, so the weights stay the last good ones.
        `indices`: the batch's dataset indices (read with `memory.exclude_self`)."""
        if isinstance(images, dict):  # the cached path's uint8 crops: the batch stage on the device (augment_on)
            images = self.augment_batch(images)
        images = images.to(self.device, non_blocking=True)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        labels = labels.to(self.device, non_blocking=True)
        self._refresh_oracle()
        with autocast(self.device, self.amp):
            embeddings = self.net(images)
        # The dataset indices only where they are read (no copy, no gather under DDP, otherwise).
        sources = (indices.to(self.device, non_blocking=True)
                   if indices is not None and self.params.memory.exclude_self else None)
        inputs = images if self.stored_inputs is not None else None
        # the global batch's loss: the same value on every rank
        loss = self.criterion(embeddings, labels, sources=sources, inputs=inputs)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # The step's one wait for the device, after the backward pass is queued: a non-finite loss must stop
        # before the update, so the weights stay the last good ones.
        value = loss.item()
        if not math.isfinite(value):
            raise NonFiniteLossError(
                f"loss is {value} at epoch {self.epoch + 1}, iteration {self.iteration + 1} "
                f"(embeddings finite: {bool(torch.isfinite(embeddings).all())}); the last good checkpoint "
                f"is {self.checkpoint_dir / 'last.pt'}")
        self.optimizer.step()
        return value, embeddings

    def epoch_batches(self):
        """What an epoch iterates: the loader, or, with the batch stage of the augmentation on a CUDA device,
        the loader's batches prepared on the GPU by a background thread ahead of the step (`DeviceBatches`)."""
        if self.device_augment is not None and self.device.type == "cuda":
            return DeviceBatches(self.loader, self.augment_batch, self.device)
        return self.loader

    def augment_batch(self, batch: dict) -> torch.Tensor:
        """`data.augment_on: device`: the batch stage of the augmentation (RandAugment, normalisation, erasing) of
        a batch of cached crops (uint8, with each sample's draws) on the training device, as the loader's workers
        would have run it."""
        assert self.device_augment is not None, "augment_batch runs only with data.augment_on: device"
        pixels = batch["pixels"].to(self.device, non_blocking=True)
        return self.device_augment.color_batch(pixels, batch["params"])

    def _refresh_oracle(self) -> None:
        """memory.method=oracle: before every `memory.oracle_every`-th step with the memory, every stored row is
        re-embedded from its input by the current model (a drift-free memory, up to oracle_every - 1 steps)."""
        c = self.criterion
        if self.params.memory.method != "oracle" or c.iteration < c.start_iteration:
            return
        if (c.iteration - c.start_iteration) % self.params.memory.oracle_every == 0:
            assert c.memory is not None  # memory.method oracle
            c.memory.reembed(self._embed_stored, c.iteration)

    def _fill_bank(self) -> None:
        """The embedded sampler's initial bank: one pass over the training images with the eval transform
        (Roth et al.'s `create_storage`); later steps refresh it row by row."""
        frame, labels = self._bank_source
        p = self.params
        loader = image_loader(frame, p.data.root, labels, self.eval_transform, p.eval.batch_size,
                              p.data.num_workers, self.device)
        self.batches.fill(embed_images(self.model, loader, self.device, self.inference_mode)[0])

    @property
    def inference_mode(self) -> InferenceMode:
        """Validation and the sampler's bank embed as training runs: its memory format, bf16 with train.amp."""
        return InferenceMode(self.channels_last, self.amp, "train")

    def _log_step(self, loss: float) -> None:
        with autocast(self.device, self.amp):
            drift = self.drift.update(self.model, self.probe.to(self.device), self.iteration)
        row = {"iteration": self.iteration, "epoch": self.epoch + 1, "loss": loss,
               "lr": self.optimizer.param_groups[0]["lr"], **drift, **self.criterion.diagnostics(),
               **self._memory_drift()}
        self.history.steps.append(row)

    def _memory_drift_due(self) -> bool:
        every = self.params.train.drift_every
        return bool(every) and self.stored_inputs is not None and self.iteration % every == 0

    def _memory_drift(self) -> dict:
        """Every `train.drift_every` steps (a step row of its own when it is not a logged step): the memory's own
        drift (`memory_drift`)."""
        if not self._memory_drift_due():
            return {}
        return memory_drift(self.criterion.memory, self._embed_stored, self.iteration,
                            self.params.train.drift_rows)

    # -- outputs --------------------------------------------------------------------------------------------
    def summary(self) -> dict:
        epochs = self.history.epochs
        best = next((e for e in epochs if e["epoch"] == self.history.best_epoch), {})
        return {
            "method": self.params.memory.method,
            "epochs": self.epoch,
            "iterations": self.iteration,
            "best_epoch": self.history.best_epoch,
            "best_val_recall@1": best.get("val_recall@1"),
            "untrained_val_recall@1": epochs[0].get("val_recall@1") if epochs else None,
            "final_loss": epochs[-1]["loss"] if epochs else None,
            "memory_rows": self.criterion.memory.memory_size if self.criterion.memory is not None else 0,
            "skipped_images": len(self.history.skipped),
            # which augmentation recipe trained it: the decode cache's tensor recipe or the PIL reference
            "decode_cache": self.data_pipeline["cache"].get("path") is not None,
            "augment_on": self.data_pipeline["augment_on"],
            "channels_last": self.channels_last,  # and what chose it (train.channels_last, or auto's probe)
            **{k: v for k, v in self.memory_format.items() if k != "channels_last"},
            "warnings": list(self.history.warnings),
            **({"memory_drift": drift} if (drift := summarize_memory_drift(self.history.steps)) else {}),
            **({"replicas": self.replicas} if self.replicas else {}),
        }

    def _record_skipped(self, indices: list[int]) -> None:
        paths = [self.train_paths[i] for i in indices]
        log.warning("epoch %d: batch trained without %d unreadable image(s): %s", self.epoch + 1, len(paths),
                    ", ".join(paths))
        self.history.skipped = sorted(set(self.history.skipped) | set(paths))

    def _write_metrics(self, seconds: float) -> None:
        write_json(self.metrics_dir / "train.json", {**self.summary(), "train_seconds": round(seconds, 1)})
        write_csv(self.metrics_dir / "train_steps.csv", self.history.steps, STEP_COLUMNS)
        write_csv(self.metrics_dir / "train_epochs.csv", self.history.epochs)


def _check_enough_classes(train_frame, manifest: str) -> None:
    """A batch needs 2 classes with a positive pair each: fewer is a DatasetError naming the classes there are
    (and the single-image ones, which can form no pair)."""
    counts = train_frame["label"].value_counts()
    usable, lone = sorted(counts[counts >= 2].index.map(str)), sorted(counts[counts < 2].index.map(str))
    if len(usable) >= 2:
        return
    def names(labels: list[str]) -> str:
        return ", ".join(labels[:10]) + (f" and {len(labels) - 10} more" if len(labels) > 10 else "")
    raise DatasetError(
        f"{manifest}: training needs at least 2 classes with 2 or more images in the train split, found "
        f"{len(usable)}{f' ({names(usable)})' if usable else ''}"
        f"{f'; single-image classes, which give no positive pair: {names(lone)}' if lone else ''}; add "
        f"images, or lower data.val_classes (it moves training classes to val)")


def fit(params: Params, resume: bool = False, progress: bool = True,
        on_epoch: EpochCallback | None = None, flow_run_id: str | None = None,
        init: InitialWeights | None = None) -> dict:
    trainer = Trainer(params, progress=progress, on_epoch=on_epoch, flow_run_id=flow_run_id, init=init)
    if resume:
        trainer.resume()
    summary = trainer.fit()
    if trainer.is_main:
        log.info("%s: best epoch %s of %s, val R@1 %s -> %s", summary["method"], summary["best_epoch"],
                 summary["epochs"], "-" if summary["best_val_recall@1"] is None else
                 f"{summary['best_val_recall@1']:.4f}", trainer.checkpoint_dir / "model.pt")
    return summary
