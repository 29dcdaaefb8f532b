"""Run by tests/serving/test_index_swap.py: `python index_builder.py OUT TAG ROWS` builds a flat index of ROWS
random unit vectors whose paths are `<TAG>/<i>.png` and saves it to OUT, as `xbn index` does (through
`CatalogueIndex.save`), so that a test can pause or kill it at its fault points (XBN_FAULT)."""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

from xbn.config import IndexConfig
from xbn.serving.index import CatalogueIndex


def main(out: str, tag: str, rows: int) -> None:
    rng = np.random.default_rng(list(tag.encode()))  # per tag, the same in every process
    ids = pd.DataFrame({"path": [f"{tag}/{i}.png" for i in range(rows)], "label": [str(i % 7) for i in range(rows)]})
    CatalogueIndex.build(rng.standard_normal((rows, 16)).astype(np.float32), ids, IndexConfig(),
                         model_sha256=tag).save(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
