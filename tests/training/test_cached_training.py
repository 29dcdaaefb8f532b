"""Training through the decode cache (`data.cache: true`) end to end: the same run whatever the number of loader
workers and wherever the batch stage of the augmentation runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from xbn.stages.prepare import prepare
from xbn.training.trainer import Trainer

FAST = ("train.epochs=1", "train.warmup_epochs=0", "data.cache=true", "memory.method=xbn")


def run(tiny_params, name: str, *overrides: str):
    params = tiny_params(*FAST, f"train.checkpoint_dir={name}", f"train.metrics_dir={name}_metrics", *overrides)
    prepare(params)
    trainer = Trainer(params, progress=False)
    summary = trainer.fit()
    return trainer, summary


def test_a_cached_run_is_the_same_with_0_or_2_workers_and_with_the_batch_stage_on_the_device(tiny_params,
                                                                                              tmp_path,
                                                                                              monkeypatch):
    monkeypatch.setenv("XBN_CACHE_DIR", str(tmp_path / "cache"))
    first, summary = run(tiny_params, "w0", "data.num_workers=0")
    assert first.data_pipeline["cache"]["reason"] == "built" and first.data_pipeline["augment_on"] == "loader"
    assert summary["iterations"] > 0 and all(torch.isfinite(p).all() for p in first.model.parameters())
    second, _ = run(tiny_params, "w2", "data.num_workers=2")
    assert second.data_pipeline["cache"]["reason"] == "found"  # the first run's file, by content
    assert second.loader.persistent_workers and second.loader.num_workers == 2
    # augment_on=device on a CPU: the batch stage runs in the training process instead of the workers' collate
    third, _ = run(tiny_params, "dev", "data.num_workers=0", "data.augment_on=device")
    assert third.data_pipeline["augment_on"] == "device" and third.device_augment is not None
    losses = [[s["loss"] for s in t.history.steps] for t in (first, second, third)]
    assert losses[0] == losses[1] == losses[2]
    for other in (second, third):
        for (name, a), b in zip(first.model.state_dict().items(), other.model.state_dict().values()):
            assert torch.equal(a, b), name
    assert len(list((Path(os.environ["XBN_CACHE_DIR"]) / "decoded").glob("decoded-*.xbnc"))) == 1


def test_cache_false_reads_with_pil(tiny_params, tmp_path, monkeypatch):
    monkeypatch.setenv("XBN_CACHE_DIR", str(tmp_path / "cache"))
    trainer, summary = run(tiny_params, "pil", "data.cache=false", "data.num_workers=auto")
    assert trainer.data_pipeline["cache"]["path"] is None and summary["iterations"] > 0
    assert not (tmp_path / "cache").exists()
    from xbn.data.dataset import ImageDataset

    assert isinstance(trainer.loader.dataset.dataset, ImageDataset)


def test_device_batches_hand_over_every_batch_in_order_and_raise_the_loaders_error():
    """`DeviceBatches` (the CUDA path's prefetching thread) on the CPU: the same batches, in order; an error in
    the loader reaches the consumer; stopping early ends the thread."""
    import threading

    from xbn.training.prefetch import DeviceBatches

    batches = [(torch.full((2, 3), float(i)), torch.tensor([i, i]), torch.tensor([2 * i, 2 * i + 1]))
               for i in range(7)]
    got = list(DeviceBatches(batches, lambda x: x * 2, torch.device("cpu")))
    assert len(got) == 7 and all(torch.equal(g[0], b[0] * 2) and torch.equal(g[1], b[1]) for g, b in
                                 zip(got, batches))

    def failing():
        yield batches[0]
        raise OSError("disk gone")

    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for batch in DeviceBatches(failing(), lambda x: x, torch.device("cpu")):
            seen.append(batch)  # noqa: PERF402 - the batches seen before the error
    assert len(seen) == 1
    for _ in DeviceBatches(batches * 100, lambda x: x, torch.device("cpu"), depth=1):
        break
    assert not [t for t in threading.enumerate() if t.name == "xbn-device-batches"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_batch_stage_on_cuda_matches_the_cpu_and_device_batches_hand_over_on_a_side_stream():
    """On a GPU: the same draws give the same images as on the CPU up to the kernels' rounding of uint8
    results (one grey level, 1/255 / std after normalisation, on a few pixels), and `DeviceBatches` delivers
    them on the training stream."""
    from xbn.data.tensor_transforms import PARAMS, TensorAugment
    from xbn.training.prefetch import DeviceBatches

    augment = TensorAugment(32, (0.5,) * 3, (0.5,) * 3)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (48, 3, 40, 40), dtype=torch.uint8, generator=generator)
    samples = [augment.sample(image) for image in images]
    pixels = torch.stack([s[0] for s in samples])
    params = torch.stack([s[1] for s in samples])
    assert params.shape == (48, PARAMS)
    cpu = augment.color_batch(pixels, params)
    cuda = augment.color_batch(pixels.cuda(), params).cpu()
    step = 1 / 255 / 0.5
    assert (cuda - cpu).abs().max() <= 2 * step + 1e-6
    assert (cuda - cpu).abs().gt(1e-6).float().mean() < 0.01
    batches = [({"pixels": pixels[i:i + 8], "params": params[i:i + 8]}, torch.arange(8), torch.arange(8))
               for i in range(0, 48, 8)]
    out = list(DeviceBatches(batches, lambda b: augment.color_batch(b["pixels"].cuda(), b["params"]),
                             torch.device("cuda")))
    assert torch.equal(torch.cat([o[0] for o in out]).cpu(), cuda) and out[0][1].is_cuda
