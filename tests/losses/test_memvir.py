"""MemVir (Ko et al. 2021): the staircase of virtual classes, their labels, the loss by hand, resume, a tiny run."""

import io

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses

from xbn.config import ConfigError, load_params
from xbn.losses.memvir import MemVir
from xbn.training.criterion import build_criterion

C, D, B = 3, 4, 6  # classes, embedding size, batch


def memvir(num_steps=3, step_gap=1, warmup=2, loss=None, seed=0) -> MemVir:
    torch.manual_seed(seed)
    return MemVir(loss or losses.NormalizedSoftmaxLoss(C, D), C, num_steps, step_gap, warmup)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return F.normalize(torch.randn(B, D, generator=g), dim=1), torch.randint(0, C, (B,), generator=g)


def test_classes_follow_the_staircase_of_past_steps():
    m = memvir(num_steps=3, step_gap=1, warmup=2)
    seen = []
    for step in range(12):
        # Before step t (t counted from the end of the warm-up): steps t-2, t-4, ..., at most 3 of them.
        t = step - 2
        expected = [batch(2 + t - 2 * k)[0] for k in range(1, min(3, max(t, 0) // 2) + 1)]
        chosen = [e for e, _, _ in m.virtual_steps()] if step >= 2 else []
        assert len(chosen) == len(expected) and all(torch.equal(a, b) for a, b in zip(chosen, expected)), step
        m(*batch(step))
        seen.append(m.last_num_classes)
    # 2 warm-up steps, then one more step's C classes every M+1 = 2 steps, up to C * (N + 1) = 12.
    assert seen == [3, 3, 3, 3, 6, 6, 9, 9, 12, 12, 12, 12]
    assert len(m.queue) == 3 * 2  # N(M+1) steps kept


def test_virtual_labels_never_collide_with_real_ones():
    m = memvir(num_steps=3, step_gap=1, warmup=0)
    for step in range(10):
        emb, labels = batch(step)
        past = m.virtual_steps()
        all_emb, all_labels, proxies = m.expand(emb, labels, m.proxies, past)
        assert all_emb.shape == (B * (1 + len(past)), D) and proxies.shape == (D, C * (1 + len(past)))
        for k, block in enumerate(all_labels.split(B)):  # block k: the batch of k(M+1) steps ago
            assert block.min() >= k * C and block.max() < (k + 1) * C
            torch.testing.assert_close(proxies[:, block], (m.proxies if k == 0 else past[k - 1][2])[:, block % C])
        m(emb, labels)


def test_loss_with_virtual_classes_equals_hand_computation():
    m = memvir(num_steps=1, step_gap=0, warmup=0)
    m(*batch(0))
    past_emb, past_labels, past_w = m.queue[-1]
    emb, labels = batch(1)
    emb.requires_grad_(True)
    loss = m(emb, labels)
    # Normalized softmax over 2C classes: [e; e_past] . normalize([W, W_past]) / T, the past labels + C.
    w = F.normalize(torch.cat([m.loss.W, past_w], dim=1), dim=0)
    logits = torch.cat([emb, past_emb]) @ w / m.loss.temperature
    expected = F.cross_entropy(logits, torch.cat([labels, past_labels + C]))
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert m.loss.W.grad is not None and m.loss.W.grad.abs().sum() > 0 and emb.grad.abs().sum() > 0
    assert m.last_num_classes == 2 * C and m.loss.W.shape == (D, C)  # the wrapped loss is left as it was


def test_without_memvir_the_loss_is_the_plain_loss():
    params = load_params(None, ["memory.method=none", "loss.name=NormalizedSoftmaxLoss", "loss.params={}",
                                "loss.miner=null", f"model.embedding_dim={D}"])
    torch.manual_seed(0)
    criterion = build_criterion(params, 60, train_labels=torch.arange(C).repeat(20).numpy())
    torch.manual_seed(0)
    plain = losses.NormalizedSoftmaxLoss(C, D)
    emb, labels = batch(0)
    assert not isinstance(criterion.loss, MemVir) and criterion.loss.W.shape == (D, C)
    assert torch.equal(criterion(emb, labels), plain(emb, labels))
    # Enabled, but still in its warm-up: the same number too.
    warm = memvir(warmup=5)
    assert torch.equal(warm(emb, labels), plain(emb, labels)) and not warm.queue


def test_queues_survive_a_state_dict_round_trip():
    m = memvir(num_steps=2, step_gap=1, warmup=1)
    for step in range(7):
        m(*batch(step))
    buffer = io.BytesIO()
    torch.save(m.state_dict(), buffer)
    buffer.seek(0)
    resumed = memvir(num_steps=2, step_gap=1, warmup=1, seed=1)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    fresh = memvir(num_steps=2, step_gap=1, warmup=1)  # same weights, empty queues
    fresh.load_state_dict({"loss.W": m.loss.W.detach().clone()}, strict=False)
    nxt = batch(7)
    assert torch.equal(resumed(*nxt), m(*nxt))
    assert resumed.last_num_classes == m.last_num_classes == 3 * C
    assert not torch.equal(fresh(*nxt), m(*nxt))


@pytest.mark.parametrize("name", ["ProxyNCALoss", "ProxyAnchorLoss", "CosFaceLoss", "ArcFaceLoss"])
def test_other_proxy_losses_take_virtual_classes(name):
    m = memvir(num_steps=2, step_gap=0, warmup=0, loss=getattr(losses, name)(num_classes=C, embedding_size=D))
    count_before = getattr(m.loss, "num_classes")
    for step in range(3):
        emb, labels = batch(step)
        loss = m(emb.requires_grad_(True), labels)
    assert m.last_num_classes == 3 * C and torch.isfinite(loss)
    loss.backward()
    assert m.proxies.grad.abs().sum() > 0
    assert m.loss.num_classes == count_before  # set for the call only


def test_memvir_needs_one_weight_per_class():
    with pytest.raises(ValueError, match="loss.memvir needs a classification/proxy loss.*SupConLoss"):
        MemVir(losses.SupConLoss(), C, 3, 1)


@pytest.mark.parametrize("overrides, match", [
    (["memory.method=axbn"], "loss.memvir.enabled needs memory.method=none"),
    (["memory.method=none", "loss.miner=PairMarginMiner"], "loss.memvir.enabled needs loss.miner=null"),
    (["memory.method=none", "loss.memvir.warmup_epochs=14"], r"loss.memvir.warmup_epochs \(14\) must be below"),
    (["memory.method=none", "loss.memvir.step_gap=-1"], "loss.memvir.step_gap"),
    # The paper trains at a constant lr: the shipped step schedule (x0.33 every 4 epochs) is refused.
    (["memory.method=none", "train.lr_gamma=0.33"], (r"constant learning rate.*train.lr_gamma=0.33 decays it "
                                                     r"every train.lr_step_epochs=4 epochs: set train.lr_gamma=1")),
    (["memory.method=none", "loss.rho.p_switch=0.35"], "loss.memvir.enabled and loss.rho.p_switch=0.35 exclude"),
])
def test_impossible_memvir_settings_are_refused_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_params(None, ["loss.memvir.enabled=true", "loss.miner=null", "train.lr_gamma=1", *overrides])


@pytest.mark.slow  # an `xbn train` subprocess: its imports alone take 4-6 s on a busy 2-core machine
def test_memvir_is_refused_up_front_with_exit_code_2(tmp_path):
    # The check runs when params load (`xbn train` exits 2 naming the keys), not at the first training step.
    import subprocess
    import sys
    from pathlib import Path

    from tests_support import ROOT

    sets = ["loss.name=NormalizedSoftmaxLoss", "loss.params={}", "loss.miner=null", "memory.method=none",
            "loss.memvir.enabled=true"]
    run = subprocess.run([str(Path(sys.executable).with_name("xbn")), "train", "--params", str(ROOT / "params.yaml"),
                          *(a for s in sets for a in ("--set", s))], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 2, run.stderr
    assert "train.lr_gamma=0.33 decays it every train.lr_step_epochs=4 epochs" in run.stderr
    assert not list(tmp_path.iterdir())  # refused before anything was read or written


def test_a_proxy_loss_is_refused_with_a_cross_batch_memory():
    params = load_params(None, ["memory.method=xbm", "loss.name=ProxyAnchorLoss", "loss.params={}",
                                f"model.embedding_dim={D}"])
    with pytest.raises(ConfigError, match="loss.name=ProxyAnchorLoss .* set memory.method=none"):
        build_criterion(params, 60, train_labels=torch.arange(C).repeat(20).numpy())


def test_tiny_training_run_with_memvir(tiny_params):
    from xbn.stages.prepare import prepare
    from xbn.training.trainer import Trainer

    params = tiny_params("loss.name=NormalizedSoftmaxLoss", "loss.params={}", "memory.method=none",
                         "loss.memvir.enabled=true", "loss.memvir.num_steps=2", "loss.memvir.step_gap=1",
                         "loss.memvir.warmup_epochs=1", "train.epochs=1", "train.lr_gamma=1")
    prepare(params)
    trainer = Trainer(params, progress=False)
    mv = trainer.criterion.loss
    steps = len(trainer.sampler)
    classes = mv.num_classes
    train_classes = trainer.manifest.loc[trainer.manifest["split"] == "train", "label"].nunique()
    assert classes == train_classes and mv.warmup_iterations == steps
    w0 = mv.loss.W.detach().clone()
    group = trainer.optimizer.param_groups[1]  # the class weights train in the head warm-up too, at 100x
    assert group["params"][0] is mv.loss.W and group["lr"] == pytest.approx(100 * params.train.warmup_lr)
    summary = trainer.fit()
    assert summary["iterations"] == mv.iteration == 2 * steps
    assert len(mv.queue) == min(steps, 4)  # queued after the 1-epoch warm-up, at most N(M+1) = 4 steps
    assert mv.last_num_classes == classes * (1 + min(2, (steps - 1) // 2))
    assert not torch.equal(mv.loss.W.detach(), w0)
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.history.epochs[1:])
