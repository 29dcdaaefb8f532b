"""`train.channels_last` (issue 28 item 1): true/false on any device, auto decided by a probe (on CUDA too, in the
training precision) that leaves the run as it was; a resumed run keeps its format; both formats give the same embeddings."""

from __future__ import annotations

import json

import pytest
import torch

from xbn.config import ModelConfig
from xbn.models import build_embedder
from xbn.stages.prepare import prepare
from xbn.training import memory_format
from xbn.training.trainer import Trainer, fit


def tiny_model():
    model, _ = build_embedder(ModelConfig(backbone="test_efficientnet", pretrained="none", embedding_dim=16))
    return model


def test_the_probe_measures_both_formats_and_leaves_the_run_as_it_was():
    model = tiny_model().train()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    rates = memory_format.probe(model, torch.device("cpu"), batch=8, image_size=32)
    assert set(rates) == {"contiguous", "channels_last"} and min(rates.values()) > 0
    assert torch.equal(torch.get_rng_state(), rng)  # the probe's input has a generator of its own
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # BN statistics included
    assert model.training and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("faster", ["contiguous", "channels_last"])
def test_auto_on_the_cpu_takes_the_faster_format(monkeypatch, faster):
    monkeypatch.setattr(memory_format, "probe", lambda *a: {"contiguous": 100.0, "channels_last": 100.0}
                        | {faster: 150.0})
    chosen, why = memory_format.choose_channels_last("auto", tiny_model(), torch.device("cpu"), 64, 32)
    assert chosen == (faster == "channels_last") and why["chosen_by"] == "auto: probe"
    assert memory_format.choose_channels_last(True, tiny_model(), torch.device("cpu"), 64, 32)[0] is True


@pytest.mark.parametrize("faster", ["contiguous", "channels_last"])
def test_auto_on_cuda_is_measured_too_in_the_training_precision(monkeypatch, faster):
    # On an H100, ResNet-50 bf16 trained 1.17x faster in NCHW (benchmarks/results/gpu.json): CUDA is no exception.
    seen = []
    monkeypatch.setattr(memory_format, "probe", lambda *a: seen.append(a) or {"contiguous": 1.0, "channels_last": 1.0}
                        | {faster: 2.0})
    chosen, _ = memory_format.choose_channels_last("auto", tiny_model(), torch.device("cuda"), 64, 32, amp=True)
    assert chosen == (faster == "channels_last") and seen[0][1:] == (torch.device("cuda"), 32, 32, True)


def test_the_probe_runs_under_autocast_when_training_does():
    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.autocast = tiny_model(), []

        def forward(self, x):
            self.autocast.append(torch.is_autocast_enabled("cpu"))
            return self.inner(x)

    for amp in (False, True):
        model = Recorder()
        memory_format.probe(model, torch.device("cpu"), batch=2, image_size=32, amp=amp)
        assert set(model.autocast) == {amp}


def test_both_formats_give_the_same_embeddings():
    model = tiny_model().eval()
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(images)
        model.to(memory_format=torch.channels_last)
        other = model(images.contiguous(memory_format=torch.channels_last))
    assert torch.nn.functional.cosine_similarity(plain, other).min() > 0.9999


def test_the_choice_is_applied_recorded_and_kept_on_resume(tiny_params, monkeypatch, tmp_path):
    params = tiny_params("train.channels_last=auto", "train.epochs=1", "train.warmup_epochs=0")
    prepare(params)
    monkeypatch.setattr(memory_format, "probe", lambda *a: {"contiguous": 1.0, "channels_last": 2.0})
    trainer = Trainer(params, progress=False)
    conv = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1))
    assert trainer.channels_last and conv.weight.is_contiguous(memory_format=torch.channels_last)
    fit(params, progress=False)
    summary = json.loads((tmp_path / "metrics/train.json").read_text())
    assert summary["channels_last"] is True and summary["chosen_by"] == "auto: probe"
    # The probe now prefers the other format, but the resumed run continues in the one it trained in.
    monkeypatch.setattr(memory_format, "probe", lambda *a: {"contiguous": 2.0, "channels_last": 1.0})
    resumed = fit(tiny_params("train.channels_last=auto", "train.epochs=2", "train.warmup_epochs=0"),
                  resume=True, progress=False)
    assert resumed["channels_last"] is True and resumed["epochs"] == 2
