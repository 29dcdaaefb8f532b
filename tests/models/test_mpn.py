"""Intra-Batch message passing (model.mpn): network, loss, config, test-time refinement, end to end."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from xbn.config import ConfigError, Params, load_params
from xbn.evaluation.mpn_rerank import kreciprocal_neighbourhoods, mpn_retrieval_metrics
from xbn.losses.mpn import IntraBatchLoss
from xbn.training.criterion import build_criterion
from xbn.models.mpn import MessagePassingNetwork, load_mpn
from xbn.stages.evaluate import evaluate
from xbn.stages.prepare import prepare
from xbn.training.trainer import Trainer

from tests_support import ROOT, brute_force_recall_at_1, split_embeddings


def _mpn(dim=16, layers=2, heads=4, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return MessagePassingNetwork(dim, layers, heads, ffn_multiplier=2, dropout=dropout)


def test_shapes_and_heads():
    mpn = _mpn(layers=2, heads=4)
    assert len(mpn.layers) == 2
    for layer in mpn.layers:
        assert layer.self_attn.num_heads == 4 and layer.self_attn.head_dim == 4  # d/M wide, concatenated
        assert layer.linear1.out_features == 32 and not layer.norm_first  # residual, then LayerNorm
    assert mpn(torch.randn(10, 16)).shape == (10, 16)
    assert mpn(torch.randn(3, 7, 16)).shape == (3, 7, 16)
    with pytest.raises(ValueError, match="not divisible"):
        MessagePassingNetwork(16, 1, 3)


@pytest.mark.parametrize("training", [False, True])
def test_permutation_equivariant_over_the_batch(training):
    mpn = _mpn().train(training)
    x = torch.randn(12, 16)
    perm = torch.randperm(12)
    torch.testing.assert_close(mpn(x[perm]), mpn(x)[perm], rtol=1e-5, atol=1e-5)
    # Every node sees the whole batch: changing one sample changes the others' outputs.
    y = x.clone()
    y[0] += 1.0
    assert not torch.allclose(mpn(y)[1:], mpn(x)[1:])


def test_padded_nodes_are_ignored():
    mpn = _mpn().eval()
    x = torch.randn(1, 5, 16)
    padded = torch.cat([x, torch.randn(1, 3, 16)], dim=1)
    mask = torch.tensor([[False] * 5 + [True] * 3])
    with torch.no_grad():
        torch.testing.assert_close(mpn(padded, mask)[:, :5], mpn(x), rtol=1e-5, atol=1e-5)


def test_loss_equals_hand_computed_label_smoothed_ce_with_temperature():
    # Manifest codes 3, 5, 9 are the training classes: the classifiers have 3 outputs, targets 0..2.
    loss_fn = IntraBatchLoss(_mpn(), train_labels=np.array([9, 3, 5, 3, 9]), temperature=0.2,
                             label_smoothing=0.1, aux_weight=0.5)
    assert loss_fn.classifier.out_features == 3 and loss_fn.aux_classifier.out_features == 3
    emb = F.normalize(torch.randn(6, 16), dim=-1)
    labels = torch.tensor([3, 3, 5, 5, 9, 9])
    targets = torch.tensor([0, 0, 1, 1, 2, 2])
    mpn_logits, aux_logits = loss_fn.logits(emb)

    def smoothed_ce(logits, eps=0.1, temperature=0.2):
        log_p = torch.log_softmax(logits / temperature, dim=1)
        q = torch.full_like(log_p, eps / 3)
        q[torch.arange(6), targets] += 1 - eps
        return -(q * log_p).sum(1).mean()

    expected = smoothed_ce(mpn_logits) + 0.5 * smoothed_ce(aux_logits)
    torch.testing.assert_close(loss_fn(emb, labels), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not a training class"):
        loss_fn(emb, torch.tensor([3, 3, 5, 5, 4, 4]))
    with pytest.raises(ValueError, match="not a training class"):
        loss_fn(emb, torch.tensor([3, 3, 5, 5, 12, 12]))


def test_without_message_passing_the_classifier_sees_the_backbone_embeddings():
    """layers 0, the paper's ablation baseline: the MPN is the identity, so its classifier (neck + linear) is
    applied to the backbone embeddings themselves, next to the auxiliary one."""
    loss_fn = IntraBatchLoss(_mpn(layers=0), train_labels=np.array([9, 3, 5]), temperature=0.2)
    loss_fn.eval()  # the neck's BatchNorm on its running statistics (0 mean, 1 variance): a fixed affine map
    emb = F.normalize(torch.randn(6, 16), dim=-1)
    assert torch.equal(loss_fn.mpn(emb), emb)
    mpn_logits, _ = loss_fn.logits(emb)
    torch.testing.assert_close(mpn_logits, loss_fn.classifier(loss_fn.neck(emb)))
    torch.testing.assert_close(mpn_logits, (emb / (1 + 1e-5) ** 0.5) @ loss_fn.classifier.weight.T)


def test_config_defaults_and_errors():
    params = load_params(ROOT / "params.yaml", ["model.mpn.enabled=true"])
    assert params.model.mpn.layers is None  # null in params.yaml: the paper's values for the dataset
    cars = params.model.mpn.resolved("cars196")
    assert (cars.layers, cars.heads) == (2, 8)
    assert params.model.mpn.resolved("glyphs").temperature == 0.2  # CUB's
    assert params.model.mpn.resolved("deepfashion2").heads == 4  # In-Shop's
    # 0 layers is a value (the paper's ablation baseline), not a null to fill from the dataset's setting.
    assert load_params(ROOT / "params.yaml", ["model.mpn.enabled=true", "model.mpn.layers=0"]
                       ).model.mpn.resolved("cars196").layers == 0
    with pytest.raises(ConfigError, match=r"model\.mpn\.test_time.*model\.mpn\.enabled"):
        load_params(ROOT / "params.yaml", ["model.mpn.test_time=true"])
    with pytest.raises(ConfigError, match=r"model\.embedding_dim \(510\).*model\.mpn\.heads \(4\)"):
        load_params(ROOT / "params.yaml",
                    ["model.mpn.enabled=true", "model.mpn.heads=4", "model.embedding_dim=510"])
    with pytest.raises(ConfigError, match="model.mpn.label_smoothing"):
        load_params(ROOT / "params.yaml", ["model.mpn.label_smoothing=1.5"])


@pytest.mark.parametrize("dataset, classes, samples", [("cub", 6, 9), ("glyphs", 6, 9), ("cars196", 10, 7),
                                                        ("sop", 15, 6), ("inshop", 14, 4)])
def test_the_papers_batch_composition_per_dataset(dataset, classes, samples):
    # Seidenschwarz et al. Sec. 4.1: classes x samples per batch; the shipped 64 / 4 yield to it.
    params = load_params(ROOT / "params.yaml", ["model.mpn.enabled=true", f"data.dataset={dataset}"])
    assert (params.train.batch_size, params.train.samples_per_class) == (classes * samples, samples)
    assert Params.model_validate(params.model_dump()) == params  # resolving twice changes nothing
    off = load_params(ROOT / "params.yaml", [f"data.dataset={dataset}"])
    assert (off.train.batch_size, off.train.samples_per_class) == (64, 4)  # without the MPN: untouched


def test_an_explicit_batch_wins_over_the_papers():
    def batch(*overrides):
        p = load_params(ROOT / "params.yaml", ["model.mpn.enabled=true", *overrides])
        return p.train.batch_size, p.train.samples_per_class

    assert batch("train.batch_size=32") == (32, 4)  # train's, moved off the shipped 64 / 4
    assert batch("train.samples_per_class=2") == (64, 2)
    assert batch("model.mpn.classes_per_batch=16", "model.mpn.samples_per_class=4") == (64, 4)
    assert batch("model.mpn.samples_per_class=3", "train.batch_size=32") == (18, 3)  # mpn's keys first
    with pytest.raises(ConfigError, match=r"15 classes x 6: train\.sampler\.candidates \(80\)"):
        load_params(ROOT / "params.yaml", ["model.mpn.enabled=true", "data.dataset=sop",
                                           "train.sampler.name=ddm", "train.sampler.candidates=80"])


def test_composes_with_the_memory():
    params = Params.model_validate({"model": {"embedding_dim": 16, "mpn": {"enabled": True, "heads": 2}},
                                    "memory": {"method": "xbm", "start": 0}, "loss": {"miner": None}})
    labels = torch.arange(4).repeat_interleave(2)
    criterion = build_criterion(params, 64, train_labels=labels.numpy())
    emb = F.normalize(torch.randn(8, 16), dim=-1)
    torch.manual_seed(0)
    total = criterion(emb, labels)
    torch.manual_seed(0)
    mpn_only = criterion.mpn_loss(emb, labels)
    assert total > mpn_only  # the XBM ranking loss on the backbone embeddings adds to the MPN losses
    with pytest.raises(ValueError, match="training labels"):
        build_criterion(params, 64)


def _on_circle(degrees):
    """Unit vectors at these angles: within 0-90 degrees the cosine ranks pairs as the angle between them."""
    rad = np.radians(np.asarray(degrees, dtype=np.float64))
    return np.stack([np.cos(rad), np.sin(rad)], axis=1).astype(np.float32)


# Seven items at these angles; the "distance" is the angle between two of them:
#         0    1    2    3    4    5    6
#   0     -   20   46   68   74   77   79        N(i, 3) = i and its 3 nearest   N(i, 2) = i and its 2 nearest
#   1    20    -   26   48   54   57   59        N(0,3) = {0, 1, 2, 3}           N(0,2) = {0, 1, 2}
#   2    46   26    -   22   28   31   33        N(1,3) = {1, 0, 2, 3}           N(1,2) = {1, 0, 2}
#   3    68   48   22    -    6    9   11        N(2,3) = {2, 3, 1, 4}           N(2,2) = {2, 3, 1}
#   4    74   54   28    6    -    3    5        N(3,3) = {3, 4, 5, 6}           N(3,2) = {3, 4, 5}
#   5    77   57   31    9    3    -    2        N(4,3) = {4, 5, 6, 3}
#   6    79   59   33   11    5    2    -
ANGLES = [10, 30, 56, 78, 84, 87, 89]


def test_kreciprocal_neighbourhood_by_hand():
    x = _on_circle(ANGLES)
    # Item 2, k = 3, k_r = 4 nodes (2 and 3 neighbours):
    #   R(2,3): 3 and 4 are in N(2,3) but 2 is not in N(3,3) nor N(4,3); 1 is mutual -> R(2,3) = {1, 2}.
    #   k/2 = round(1.5) = 2. R(1,2) = {1, 0, 2} (0 and 2 both hold 1 in their N(.,2)); 2 of its 3 lie in
    #   R(2,3): 2 >= 2/3 * 3, so it joins (Zhong's >=; a strict > would not). R(2,2) = {2, 1} (3's N(3,2)
    #   lacks 2), already in. Expanded set {0, 1, 2}: without 2 itself, nearest first, 1 (26) then 0 (46);
    #   padded to 3 neighbours with 2's nearest not in it: 3 (22). Plain kNN would give [3, 1, 4].
    idx, valid, expanded = kreciprocal_neighbourhoods(x, x, 3, 4, leave_one_out=True)
    assert idx[2].tolist() == [1, 0, 3] and valid[2].all() and expanded[2] == 2
    #   Item 3: R(3,3) = {3, 4, 5, 6} (4, 5, 6 all hold 3 in N(.,3)); nothing to pad, the nearest first.
    assert idx[3].tolist() == [4, 5, 6] and expanded[3] == 3
    #   k_r = 3 cuts the set to its nearest 2: item 2 keeps [1, 0] (the expansion outranks the nearer 3).
    assert kreciprocal_neighbourhoods(x, x, 3, 3, leave_one_out=True)[0][2].tolist() == [1, 0]

    # Query -> gallery: a query at 50 degrees; distances to 0..6: 40, 20, 6, 28, 34, 37, 39.
    #   N(q,3) = {2, 1, 3}. q counts as in N(j,3) when it beats j's 3rd nearest other: j=2's is 4 at 28 > 6,
    #   j=1's is 3 at 48 > 20, j=3's is 6 at 11 < 28 -> R(q,3) = {1, 2}. R(1,2) = {0, 1, 2} has 2 of 3 in it
    #   -> joins. Expanded {0, 1, 2} by distance: [2, 1, 0] (plain kNN: [2, 1, 3]).
    idx, valid, expanded = kreciprocal_neighbourhoods(_on_circle([50]), x, 3, 4, leave_one_out=False)
    assert idx.tolist() == [[2, 1, 0]] and valid.all() and expanded.tolist() == [3]

    # More nodes than references: the rest is masked out, never a repeated item.
    idx, valid, _ = kreciprocal_neighbourhoods(x[:3], x[:3], 1, 6, leave_one_out=True)
    assert valid.sum(1).tolist() == [2, 2, 2] and idx[0][valid[0]].tolist() == [1, 2]


def test_test_time_metrics_in_both_protocols():
    mpn = _mpn().eval()
    emb = F.normalize(torch.randn(20, 16), dim=-1).numpy()
    labels = np.arange(20) // 4
    loo = mpn_retrieval_metrics(mpn, emb, labels, k=3, size=6, ks=(1, 2))
    qg = mpn_retrieval_metrics(mpn, emb[::2], labels[::2], emb[1::2], labels[1::2], k=3, size=6, ks=(1, 2),
                               nmi=False)
    for m in (loo, qg):
        assert 0 <= m["recall@1"] <= m["recall@2"] <= 1 and 0 < m["reciprocal_neighbours"] <= 9


@pytest.mark.slow
def test_training_with_mpn_and_test_time_evaluation(tiny_params):
    params = tiny_params("memory.method=none", "model.mpn.enabled=true", "model.mpn.test_time=true",
                         "model.mpn.test_k=3", "train.epochs=1", "train.warmup_epochs=0",
                         "eval.baseline=false")
    prepare(params)
    trainer = Trainer(params, progress=False)
    train_classes = trainer.manifest.loc[trainer.manifest["split"] == "train", "label"].nunique()
    assert trainer.criterion.mpn_loss.classifier.out_features == train_classes  # not val/test classes
    before = {k: v.clone() for k, v in trainer.criterion.mpn_loss.state_dict().items()}
    summary = trainer.fit()
    assert summary["iterations"] > 0 and np.isfinite(summary["final_loss"])
    after = trainer.criterion.mpn_loss.state_dict()
    assert not torch.equal(before["mpn.layers.0.linear1.weight"], after["mpn.layers.0.linear1.weight"])
    saved = torch.load("models/last.pt", weights_only=True)["criterion"]
    assert any(k.startswith("mpn_loss.mpn.layers.0") for k in saved)
    assert isinstance(load_mpn("models/mpn.pt"), MessagePassingNetwork)

    metrics = evaluate(params)
    written = json.loads(Path("metrics/eval.json").read_text())
    # Both metric sets, recomputed from the saved model and MPN: plain by brute force, MPN over k = test_k.
    emb, labels = split_embeddings(params, "test")
    assert written["recall@1"] == pytest.approx(brute_force_recall_at_1(emb, labels), abs=1e-12)
    again = mpn_retrieval_metrics(load_mpn("models/mpn.pt"), emb, labels, k=3, size=params.train.batch_size,
                                  ks=params.eval.k, nmi=False)
    assert written["mpn"]["recall@1"] == pytest.approx(again["recall@1"], abs=1e-12)
    assert written["mpn"]["num_queries"] == metrics["num_queries"]


@pytest.mark.slow
def test_without_mpn_a_stub_is_written_and_test_time_refuses_it(tiny_params):
    params = tiny_params("memory.method=none", "train.epochs=0", "train.warmup_epochs=0")
    prepare(params)
    Trainer(params, progress=False).fit()
    with pytest.raises(ValueError, match="model.mpn.enabled=false"):
        load_mpn("models/mpn.pt")
