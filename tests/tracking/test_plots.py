"""The pictures: the retrieval grid's frames and the training plots."""

from __future__ import annotations

import numpy as np
import pandas as pd
from PIL import Image

from xbn.tracking import plot_training, retrieval_grid, retrieval_grid_from_embeddings
from xbn.tracking.plots import CORRECT_COLOUR, QUERY_COLOUR, WRONG_COLOUR


def solid(path, colour):
    Image.new("RGB", (20, 12), colour).save(path)
    return path


def test_the_retrieval_grid_frames_correct_results_green_and_wrong_ones_red(tmp_path):
    img = solid(tmp_path / "a.png", (128, 128, 128))
    out = retrieval_grid([img, img], ["cat", "dog"], [[img, img, img], [img, img, img]],
                         [["cat", "dog", "cat"], ["cat", "dog", "dog"]], tmp_path / "grid.png",
                         thumb=40, frame=4)
    grid = np.asarray(Image.open(out).convert("RGB"))
    gap, cell_w, cell_h = 6, 48, 48 + 14
    expected = [[QUERY_COLOUR, CORRECT_COLOUR, WRONG_COLOUR, CORRECT_COLOUR],
                [QUERY_COLOUR, WRONG_COLOUR, CORRECT_COLOUR, CORRECT_COLOUR]]
    for row, colours in enumerate(expected):
        y = gap + row * (cell_h + gap) + 1  # inside the top frame bar
        xs = [gap] + [gap + cell_w + 3 * gap + j * (cell_w + gap) for j in range(3)]
        for x, colour in zip(xs, colours):
            assert tuple(grid[y, x + cell_w // 2]) == colour
            assert tuple(grid[y + 24, x + 1]) == colour  # the left bar, halfway down
            assert tuple(grid[y + 24, x + cell_w // 2]) == (128, 128, 128)  # the image inside


def test_the_grid_from_embeddings_leaves_the_query_out(tmp_path):
    paths = [solid(tmp_path / f"{i}.png", (i * 40, 0, 0)).name for i in range(4)]
    queries = pd.DataFrame({"path": paths, "label": ["a", "a", "b", "b"]})
    emb = np.array([[1, 0], [0.9, 0.1], [0, 1], [0.1, 0.9]], dtype=np.float32)
    out = retrieval_grid_from_embeddings(tmp_path, queries, emb, None, None, tmp_path / "g.png",
                                         n_queries=2, k=1)
    grid = np.asarray(Image.open(out).convert("RGB"))
    x = 6 + 106 + 18 + 53  # the first neighbour's top bar (default thumb 96, frame 5)
    assert tuple(grid[7, x]) == CORRECT_COLOUR and tuple(grid[6 + 120 + 6 + 1, x]) == CORRECT_COLOUR


def test_training_plots_are_drawn_from_the_csvs(tmp_path):
    pd.DataFrame({"epoch": [0, 1, 2], "loss": [np.nan, 1.0, 0.5], "val_recall@1": [0.1, 0.2, 0.3]}).to_csv(
        tmp_path / "e.csv", index=False)
    steps = pd.DataFrame({"iteration": [1, 2], "loss": [1.0, 0.9], "gain": [0.5, 0.3]})
    steps.to_csv(tmp_path / "s.csv", index=False)
    written = plot_training(tmp_path / "e.csv", tmp_path / "s.csv", tmp_path / "plots")
    assert [p.name for p in written] == ["training_curves.png", "memory_diagnostics.png"]
    assert Image.open(written[0]).size[0] > 400
    assert plot_training(tmp_path / "missing.csv", tmp_path / "none.csv", tmp_path / "p2") == []
