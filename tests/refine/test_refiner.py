"""The context refiner (seed 001): Eq. 3 by hand, contexts without the query, and a real gain on clusters."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from xbn.config import load_params
from xbn.evaluation.metrics import retrieval_metrics
from xbn.models.refiner import ContextBlock, ContextRefiner
from xbn.stages.refine import context_indices, fit_refiner, refined_metrics


def test_block_equals_eq3_by_hand():
    torch.manual_seed(0)
    d, heads, k = 4, 2, 3
    block = ContextBlock(d, heads)
    with torch.no_grad():  # out_proj starts at zero (an identity block): give it weights to check
        for p in block.parameters():
            p.copy_(torch.randn_like(p))
    z, ctx = torch.randn(2, d), torch.randn(2, k, d)
    w, b = block.attention.in_proj_weight.detach(), block.attention.in_proj_bias.detach()
    wo, bo = block.attention.out_proj.weight.detach(), block.attention.out_proj.bias.detach()
    expected = torch.empty(2, d)
    for i in range(2):
        q = w[:d] @ z[i] + b[:d]
        keys = ctx[i] @ w[d:2 * d].T + b[d:2 * d]
        values = ctx[i] @ w[2 * d:].T + b[2 * d:]
        dh = d // heads
        out = []
        for h in range(heads):
            s = slice(h * dh, (h + 1) * dh)
            scores = [float(q[s] @ keys[j, s]) / math.sqrt(dh) for j in range(k)]
            e = [math.exp(x - max(scores)) for x in scores]
            a = [x / sum(e) for x in e]
            out.append(sum(a[j] * values[j, s] for j in range(k)))
        expected[i] = z[i] + wo @ torch.cat(out) + bo  # Eq. 3: residual update
    torch.testing.assert_close(block(z, ctx), expected, rtol=1e-5, atol=1e-5)

    refiner = ContextRefiner(d, blocks=2, heads=heads)
    refiner.blocks[0].load_state_dict(block.state_dict())
    twice = F.normalize(refiner.blocks[1](block(z, ctx), ctx), dim=-1)
    torch.testing.assert_close(refiner(z, ctx), twice)


def test_untrained_refiner_is_the_identity():
    z = F.normalize(torch.randn(5, 8), dim=1)
    torch.testing.assert_close(ContextRefiner(8, blocks=3, heads=2)(z, torch.randn(5, 4, 8)), z)


def test_context_excludes_the_query_itself():
    x = F.normalize(torch.randn(50, 8, generator=torch.Generator().manual_seed(0)), dim=1)
    x = torch.cat([x, x[:10]])  # exact duplicates: the copy stays a neighbour, the row itself never does
    ctx = context_indices(x, None, 5)
    assert ctx.shape == (60, 5)
    assert not (ctx == torch.arange(60)[:, None]).any()
    assert all(int(i) + 50 in ctx[i].tolist() for i in range(10))
    gallery = context_indices(x[:3], x[:50], 4)  # query -> gallery: nothing excluded, the query is its own nn
    assert (gallery[:, 0] == torch.arange(3)).all()

    # The identity refiner scores exactly the plain leave-one-out protocol: its own plain row never matches.
    labels = np.arange(60) % 25
    plain = retrieval_metrics(x, labels, ks=(1, 2), nmi=False)
    same = refined_metrics(ContextRefiner(8, 1, 2), x, labels, None, None, 5, ks=(1, 2), nmi=False)
    assert same == pytest.approx(plain)


def clusters(classes, per_class, seed, dim=16, nuisance_dims=4, spread=0.8):
    """Unit-norm clusters blurred along a nuisance subspace shared by all classes (a view or lighting change):
    the context of similar points shares the nuisance, so it can be read off the neighbourhood."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(7)))[0][:, :nuisance_dims]
    centers = F.normalize(torch.randn(classes, dim, generator=g), dim=1)
    labels = np.repeat(np.arange(classes), per_class)
    x = (centers[labels] + spread * torch.randn(len(labels), nuisance_dims, generator=g) @ basis.T
         + 0.1 * torch.randn(len(labels), dim, generator=g) / dim**0.5)
    return F.normalize(x, dim=1), labels


def test_training_on_noisy_clusters_improves_recall():
    params = load_params(None, ["refine.enabled=true", "refine.k=5", "refine.epochs=4", "refine.lr=1e-2",
                                "refine.blocks=1", "refine.heads=2", "refine.batch_size=64"])
    train, val, test = clusters(60, 8, 0), clusters(30, 8, 1), clusters(30, 8, 2)  # disjoint classes
    summary = fit_refiner(params, train, val)
    assert summary["val_refined_recall@1"] > summary["val_plain_recall@1"] + 0.15  # measured 0.546 -> 0.792
    assert summary["served"] == "refined" and summary["epoch"] > 0
    plain = retrieval_metrics(*test, ks=(1,), nmi=False)["recall@1"]
    refined = refined_metrics(summary["refiner"], *test, None, None, 5, ks=(1,), nmi=False)["recall@1"]
    assert refined > plain + 0.15  # unseen classes: measured 0.542 -> 0.804
