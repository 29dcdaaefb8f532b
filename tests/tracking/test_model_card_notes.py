"""The model card's notes on the trained loss (issue 52): the departure from seed 000's XBN is named only for the
methods that paper describes, the centred gradient only when the run trained with it, and every memory run
points at the evidence for its method."""

from __future__ import annotations

import pytest
from tests_support import ROOT

from xbn.config import load_params
from xbn.stages.model_card import CENTRED, DEPARTURE, EVIDENCE, loss_notes


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], [CENTRED, EVIDENCE]),  # the shipped default: XBM + the minibatch loss, as the official XBM code
    (["memory.method=xbn"], [DEPARTURE, EVIDENCE]),
    (["memory.method=axbn", "memory.add_batch_loss=false"], [EVIDENCE]),  # seed 000's own recipe
    (["memory.method=xbn", "memory.center_gradient=true"], [DEPARTURE, CENTRED, EVIDENCE]),
    (["memory.method=xbm", "memory.center_gradient=false"], [EVIDENCE]),
    (["memory.method=none"], []),
])
def test_the_card_notes_follow_the_trained_memory(overrides, expected):
    assert loss_notes(load_params(ROOT / "params.yaml", overrides)) == expected
