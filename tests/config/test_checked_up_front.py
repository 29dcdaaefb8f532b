"""Numbers that cannot be meant and names that resolve to nothing are refused when params load, by key,
before any data is read: never a traceback after the data and the model are loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests_support import ROOT
from xbn.config import ConfigError, load_params
from xbn.stages.names import load_checked
from xbn.training.criterion import build_criterion

XBN = str(Path(sys.executable).with_name("xbn"))


@pytest.mark.parametrize("override, named", [
    ("memory.kalman.q=.inf", "memory.kalman.q"),
    ("memory.kalman.r=.inf", "memory.kalman.r"),
    ("memory.kalman.r=1e400", "memory.kalman.r"),  # --set reads it as float('1e400') = inf
    ("memory.kalman.p0=.nan", "memory.kalman.p0"),
    ("memory.kalman.q=1e300", "memory.kalman.q"),  # finite, but P + Q overflows after a few steps
    ("train.lr=.inf", "train.lr"),
    ("train.lr=1e400", "train.lr"),
    ("train.lr=1e5", "train.lr"),
    ("train.warmup_lr=.nan", "train.warmup_lr"),
    ("train.weight_decay=3", "train.weight_decay"),
    ("memory.size=.inf", "memory.size"),
    ("memory.ema_momentum=.nan", "memory.ema_momentum"),
    ("loss.memvir.warmup_epochs=.inf", "loss.memvir.warmup_epochs"),
    ("loss.lr_multiplier=1e9", "loss.lr_multiplier"),
    ("refine.lr=.inf", "refine.lr"),
    ("registry.tolerance=.inf", "registry.tolerance"),
    ("registry.min_improvement=2", "registry.min_improvement"),
    ("tune.timeout_s=.inf", "tune.timeout_s"),
    ("tune.space={memory.size: {type: float, low: 0.1, high: .inf}}", "tune.space"),
    ("tune.space={train.lr: {type: float, low: 1e-5, high: 1e-3, step: 0}}", "tune.space.train.lr"),
    ("loss.params.temperature=.inf", "loss.params"),
    ("loss.miner_params.pos_margin=.nan", "loss.miner_params"),
    ("refine.loss_params.alpha=1e400", "refine.loss_params"),
    ("train.samples_per_class=1", "train.samples_per_class"),  # a ranking loss then has no positive pair
])
def test_non_finite_and_absurd_numbers_are_refused_by_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_params(ROOT / "params.yaml", [override])


def test_numbers_in_a_params_file_are_checked_as_in_an_override(tmp_path):
    # YAML reads 1e400 (no dot) as a string; the schema parses it as inf, which must not pass either, and in
    # the free-form loss.params it must not reach the loss as the string '1e400'.
    for section, body in (("train", "lr: 1e400"), ("memory", "kalman: {q: .inf}"),
                          ("loss", "params: {temperature: 1e400}"), ("loss", "params: {temperature: .NaN}")):
        path = tmp_path / "params.yaml"
        path.write_text(f"{section}:\n  {body}\n")
        with pytest.raises(ConfigError, match=section):
            load_params(path)
    path.write_text("loss:\n  params: {temperature: 5e-2}\n")  # YAML 1.1 reads 5e-2 as a string too
    assert load_params(path).loss.params == {"temperature": 0.05}


def test_a_memory_beyond_the_available_ram_fails_before_allocating():
    params = load_params(None, ["memory.method=xbn", "memory.size=1e12", "model.embedding_dim=512"])
    with pytest.raises(ConfigError, match=r"memory\.size=1e\+12 gives 1000000000000 rows x 512 dims") as info:
        build_criterion(params, num_train_images=1000)
    assert "available" in str(info.value)
    fits = build_criterion(load_params(None, ["memory.method=xbn", "memory.size=5000"]), 1000)
    assert fits.memory.memory_size == 5000 and fits.memory.embedding_memory.dtype == torch.float32


@pytest.mark.parametrize("overrides, message", [
    (["loss.name=SupConLos"], "loss.name: unknown loss 'SupConLos'; close matches: SupConLoss"),
    (["loss.name=tripletmarginloss"], "unknown loss 'tripletmarginloss'; close matches: TripletMarginLoss"),
    (["loss.miner=PairMarginMine"], "loss.miner: unknown miner 'PairMarginMine'; close matches: PairMarginM"),
    (["loss.miner=SoftHardMinr", "loss.miner_params={}"], "close matches: SoftHardMiner"),  # ours
    (["model.backbone=tf_efficientnet_lite"],
     "model.backbone: timm has no model 'tf_efficientnet_lite'; close matches: tf_efficientnet_lite4"),
    (["model.backbone=resnet50"], "model.backbone: no offline weights for 'resnet50' (model.pretrained="),
    (["loss.params.temprature=0.1"],
     "loss.params.temprature: loss.name=SupConLoss takes no argument 'temprature'; close matches: temp"),
    (["loss.miner_params.pos_margn=0.1"], "loss.miner_params.pos_margn: loss.miner=PairMarginMiner takes no"),
    (["refine.loss_params.gamma=2"], "refine.loss_params.gamma: MultiSimilarityLoss (the refiner's loss)"),
    (["loss.name=CrossBatchMemory", "loss.params={}"], "loss.params: loss.name=CrossBatchMemory needs loss"),
    (["train.device=gpu"], "train.device: 'gpu' is not auto, cpu, cuda or cuda:N (close matches: cpu)"),
    (["train.device=cuda:64"], "train.device: cuda:64 but this machine has"),
])
def test_names_that_resolve_to_nothing_are_refused_by_key_with_close_matches(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_checked(ROOT / "params.yaml", overrides)
    assert message in str(info.value)


@pytest.mark.parametrize("overrides", [
    ["loss.name=TripletMarginLoss", "loss.params={margin: 0.2}", "loss.miner=SoftHardMiner",
     "loss.miner_params={seed: 3}"],
    ["loss.name=NormalizedSoftmaxLoss", "loss.params={temperature: 0.05}", "loss.miner=null",
     "memory.method=none"],  # num_classes and embedding_size are filled in from the data: never required
    ["loss.name=ArcFaceLoss", "loss.params={margin: 28.6, scale: 64}", "loss.miner=null",
     "memory.method=none"],
    ["model.backbone=resnet18.a1_in1k", "model.pretrained=timm", "train.device=cpu"],
    ["model.backbone=test_efficientnet", "model.pretrained=none"],
])
def test_names_that_resolve_pass(overrides):
    load_checked(ROOT / "params.yaml", overrides)


def test_xbn_train_with_a_misspelt_loss_exits_2_before_reading_any_data(tmp_path):
    # The case: no manifest here, so anything that read data first would report a missing label file.
    proc = subprocess.run([XBN, "train", "--params", str(ROOT / "params.yaml"), "--set",
                           "loss.name=SupConLos"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == \
        "xbn: loss.name: unknown loss 'SupConLos'; close matches: SupConLoss, PNPLoss"
    assert not list(tmp_path.iterdir())  # nothing read, nothing written
    # A stage that builds no loss loads the same params without importing the libraries.
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"loss": {"name": "SupConLos"}}))
    assert load_params(params).loss.name == "SupConLos"
