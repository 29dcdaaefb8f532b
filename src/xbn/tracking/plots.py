"""The pictures a run carries: training curves and memory diagnostics drawn from the trainer's CSVs, and a
retrieval grid (queries with their top-k results, correct ones framed green, wrong ones red).

No MLflow here: the evaluate stage can draw the grid where it has the embeddings, and `log_*` ships the files.
Figures are built with `matplotlib.figure.Figure` rather than pyplot, so no global backend state is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image, ImageDraw, ImageFont, ImageOps

from xbn.data.images import open_rgb
from xbn.utils.io import atomic_path

QUERY_COLOUR = (40, 90, 200)
CORRECT_COLOUR = (0, 170, 0)
WRONG_COLOUR = (220, 0, 0)

# (title, CSV columns) of each panel; a panel whose columns the CSV lacks is left out (e.g. no Kalman gain
# for plain XBM, no drift before the second probe check).
_EPOCH_PANELS = (("training loss", ("loss",)), ("validation", ("val_recall@1", "val_map@r")))
_STEP_PANELS = (
    ("Kalman gain", ("gain",)),
    ("memory std", ("memory_std", "batch_std")),
    ("feature drift", ("drift_mean", "drift_max")),
    # seed 000 Fig. 2: the memory's rows against fresh embeddings of their inputs (issue 42)
    ("memory drift", ("stored_drift_mean", "mapped_drift_mean")),
    ("map scale", ("scale_min", "scale_median", "scale_max")),
)


def plot_training(epochs_csv: str | Path, steps_csv: str | Path, out_dir: str | Path) -> list[Path]:
    """Draw `training_curves.png` (loss and validation R@1 per epoch) and `memory_diagnostics.png` (Kalman
    gain, memory std, feature drift, the memory's drift and the map's scale per step) into `out_dir`; returns the files written."""
    out_dir = Path(out_dir)
    written = []
    for csv, x, panels, name in (
        (epochs_csv, "epoch", _EPOCH_PANELS, "training_curves.png"),
        (steps_csv, "iteration", _STEP_PANELS, "memory_diagnostics.png"),
    ):
        frame = _read_csv(csv)
        if frame is not None and x in frame and _plot_panels(frame, x, panels, out_dir / name):
            written.append(out_dir / name)
    return written


def _read_csv(path: str | Path) -> pd.DataFrame | None:
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return None
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return None


def _plot_panels(frame: pd.DataFrame, x: str, panels, out_png: Path) -> bool:
    from matplotlib.figure import Figure

    present = [(title, [c for c in cols if c in frame and frame[c].notna().any()]) for title, cols in panels]
    present = [(title, cols) for title, cols in present if cols]
    if not present:
        return False
    fig = Figure(figsize=(4.2 * len(present), 3.2), layout="constrained")
    for ax, (title, cols) in zip(np.atleast_1d(fig.subplots(1, len(present))), present):
        for col in cols:
            series = frame[[x, col]].dropna()
            ax.plot(series[x], series[col], marker="o" if len(series) < 30 else None, ms=3, label=col)
        ax.set_title(title)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
        if len(cols) > 1:
            ax.legend(fontsize=8)
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return True


def plot_evaluation(recall_csv: str | Path, spectrum_csv: str | Path, out_png: str | Path) -> Path | None:
    """`evaluation.png`: test recall@k against k, and the training embeddings' singular-value spectrum (its
    share of the sum; Roth et al. 2020: a flatter spectrum generalises better) when it was measured. None
    when there is no recall@k file."""
    from matplotlib.figure import Figure

    recall, spectrum = _read_csv(recall_csv), _read_csv(spectrum_csv)
    if recall is None or recall.empty:
        return None
    panels = 1 + (spectrum is not None and not spectrum.empty)
    fig = Figure(figsize=(4.4 * panels, 3.4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, panels))
    axes[0].plot(recall["k"], recall["recall"], marker="o")
    for k, r in zip(recall["k"], recall["recall"], strict=True):
        axes[0].annotate(f"{r:.3f}", (k, r), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    axes[0].set(xscale="log", xlabel="k", ylabel="recall@k", title="test recall@k", ylim=(0, 1.05))
    axes[0].set_xticks(recall["k"], [str(k) for k in recall["k"]])
    if spectrum is not None and panels == 2:
        axes[1].plot(spectrum["index"], spectrum["normalized"])
        axes[1].set(yscale="log", xlabel="singular value (1 = largest)", ylabel="share of the sum",
                    title="train embedding spectrum")
    for ax in axes:
        ax.grid(alpha=0.3)
    out_png = Path(out_png)
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return out_png


def plot_drift(observed: float, null: np.ndarray, p_value: float, alpha: float, old: np.ndarray, new: np.ndarray,
               out_png: str | Path) -> Path:
    """`drift.png`: the MMD^2 permutation null with the observed value marked (and p), beside the two samples'
    embeddings projected on the pooled sample's first two principal axes (the champion's unchanged images
    against the new or changed ones)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.hist(null, bins=40, color="0.75", edgecolor="0.55", label=f"{len(null)} permutations")
    left.axvline(observed, color="C3", label=f"observed MMD² {observed:.4f} (p = {p_value:.3f})")
    left.set(xlabel="MMD² under random relabelling", ylabel="permutations",
             title=f"drift: {'significant' if p_value < alpha else 'not significant'} at alpha {alpha:g}")
    left.legend(fontsize=8)
    pooled = np.concatenate([old, new]).astype(np.float64)
    centred = pooled - pooled.mean(0)
    axes = np.linalg.svd(centred, full_matrices=False)[2][:2]  # the first two principal directions
    points = centred @ axes.T
    right.scatter(*points[:len(old)].T, s=8, alpha=0.6, label=f"unchanged ({len(old)})")
    right.scatter(*points[len(old):].T, s=8, alpha=0.6, label=f"new or changed ({len(new)})")
    right.set(xlabel="principal axis 1", ylabel="principal axis 2", title="the champion's embeddings")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    out_png = Path(out_png)
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return out_png


def plot_gate(means: np.ndarray, difference: float, low: float, high: float, min_improvement: float,
              title: str, out_png: str | Path) -> Path:
    """`gate_bootstrap.png`: the paired bootstrap's distribution of mean(challenger - champion), with the
    observed difference, the interval and the improvement the gate requires of its lower bound marked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.subplots()
    ax.hist(means, bins=40, color="0.75", edgecolor="0.55")
    ax.axvspan(low, high, color="C0", alpha=0.15, label=f"interval [{low:+.4f}, {high:+.4f}]")
    ax.axvline(difference, color="C0", label=f"observed {difference:+.4f}")
    ax.axvline(min_improvement, color="C3", linestyle="--",
               label=f"the lower bound must exceed {min_improvement:+.4f}")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set(xlabel="mean per-query difference, challenger - champion (bootstrap resamples)", ylabel="resamples",
           title=title)
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    out_png = Path(out_png)
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return out_png


def retrieval_grid(
    query_paths: Sequence[str | Path],
    query_labels: Sequence,
    neighbour_paths: Sequence[Sequence[str | Path]],
    neighbour_labels: Sequence[Sequence],
    out_png: str | Path,
    *,
    thumb: int = 96,
    frame: int = 5,
) -> Path:
    """One row per query: the query (framed blue), then its neighbours in rank order, framed green when their
    label equals the query's and red otherwise; each cell is captioned with its label."""
    if not (len(query_paths) == len(query_labels) == len(neighbour_paths) == len(neighbour_labels)):
        raise ValueError("query_paths, query_labels, neighbour_paths and neighbour_labels differ in length")
    if any(len(p) != len(lab) for p, lab in zip(neighbour_paths, neighbour_labels)):
        raise ValueError("a query's neighbour_paths and neighbour_labels differ in length")
    if not query_paths:
        raise ValueError("retrieval_grid needs at least one query")
    k = max(len(p) for p in neighbour_paths)
    gap, caption = 6, 14
    cell_w, cell_h = thumb + 2 * frame, thumb + 2 * frame + caption
    # A wider gap after the query column separates it from its results.
    width = gap + (cell_w + 3 * gap) + k * (cell_w + gap)
    height = gap + len(query_paths) * (cell_h + gap)
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()

    def cell(path, label, colour, x, y):
        draw.rectangle((x, y, x + cell_w - 1, y + thumb + 2 * frame - 1), fill=colour)
        tile = ImageOps.pad(open_rgb(path), (thumb, thumb), color="white")  # as the model saw it
        canvas.paste(tile, (x + frame, y + frame))
        draw.text((x + frame, y + thumb + 2 * frame + 1), str(label)[:18], fill=(60, 60, 60), font=font)

    for row, (qpath, qlabel) in enumerate(zip(query_paths, query_labels)):
        y = gap + row * (cell_h + gap)
        cell(qpath, qlabel, QUERY_COLOUR, gap, y)
        for j, (npath, nlabel) in enumerate(zip(neighbour_paths[row], neighbour_labels[row])):
            colour = CORRECT_COLOUR if str(nlabel) == str(qlabel) else WRONG_COLOUR
            cell(npath, nlabel, colour, gap + cell_w + 3 * gap + j * (cell_w + gap), y)
    out_png = Path(out_png)
    with atomic_path(out_png) as tmp:
        canvas.save(tmp, format="PNG")
    return out_png


def retrieval_grid_from_embeddings(
    root: str | Path,
    queries: pd.DataFrame,
    query_embeddings: np.ndarray,
    references: pd.DataFrame | None,
    reference_embeddings: np.ndarray | None,
    out_png: str | Path,
    *,
    n_queries: int = 6,
    k: int = 5,
) -> Path:
    """`retrieval_grid` for a few evenly spaced queries of a manifest split, by exact cosine top-k.

    `references=None` is the leave-one-out protocol (a query is not its own neighbour), as in
    `xbn.evaluation.embed.retrieval_protocol`. Only `n_queries` rows are scored, so large galleries are cheap.
    """
    q = np.asarray(query_embeddings, dtype=np.float32)
    paired = references is None or (reference_embeddings is not None
                                    and len(references) == len(reference_embeddings))
    if len(q) != len(queries) or not paired:
        raise ValueError("retrieval grid: the rows and the embeddings do not pair up (an image skipped as "
                         "unreadable must be left out of the rows too)")
    leave_one_out = references is None
    if references is None:
        references, r = queries, q
    else:
        r = np.asarray(reference_embeddings, dtype=np.float32)
    pick = np.unique(np.linspace(0, len(q) - 1, min(n_queries, len(q))).astype(int))
    scores = q[pick] @ r.T
    if leave_one_out:
        scores[np.arange(len(pick)), pick] = -np.inf
    k = min(k, len(r) - int(leave_one_out))
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    root = Path(root)
    q_paths, q_labels = queries["path"].to_numpy(), queries["label"].astype(str).to_numpy()
    r_paths, r_labels = references["path"].to_numpy(), references["label"].astype(str).to_numpy()
    return retrieval_grid(
        [root / q_paths[i] for i in pick],
        list(q_labels[pick]),
        [[root / r_paths[j] for j in row] for row in top],
        [list(r_labels[row]) for row in top],
        out_png,
    )
