"""The README's library snippet runs as written (issue 43): a user copies it into their own loop."""

from __future__ import annotations

import re

import pytest
import torch

from tests_support import ROOT


def snippet(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_memory_in_your_own_loop_trains_and_corrects_its_rows():
    scope: dict = {}
    torch.manual_seed(0)
    exec(compile(snippet("Use the memory in your own training loop"), "README.md", "exec"), scope)
    memory = scope["memory_loss"]
    assert memory.num_valid == 20 * 64 and torch.isfinite(scope["loss"])
    assert type(memory.moments).__name__ == "BatchMoments"  # method="xbn": the drift correction is on
    # The stored rows were rescaled to the last batch's moments (seed 000 Eq. 6), not left as written.
    assert memory.last_diagnostics["scale"].item() != pytest.approx(1.0, abs=1e-6)


def test_a_wrong_memory_key_is_named():
    from xbn import cross_batch_memory
    from pytorch_metric_learning import losses

    with pytest.raises(TypeError, match="ema_momentm"):
        cross_batch_memory(losses.ContrastiveLoss(), 8, 64, method="ema", ema_momentm=0.2)
    with pytest.raises(ValueError, match="method"):
        cross_batch_memory(losses.ContrastiveLoss(), 8, 64, method="xbnn")
