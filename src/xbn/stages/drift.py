"""The drift report of a scheduled retraining: the current data against the champion's, before training.

What it compares (`reports/drift.{json,md}`, logged on the run, one line in the summary):
- counts: images and classes then and now; classes and images added, removed, changed (the DVC snapshots);
- the images' size and mode distributions: the validation profile of the champion's run against this one's;
- embeddings: the champion's embeddings of a seeded sample of images it trained on that are unchanged, against a
  sample of the images added or changed since, as a kernel two-sample test (MMD with an RBF kernel at the
  median distance, p-value by permutation: Gretton et al. 2012). Images the champion saw that are gone cannot
  be embedded, so "old" means what is still there unchanged;
- per class present in both: the cosine distance between the centroid of its unchanged images and that of its
  new ones (the largest shifts listed).
A p-value below `drift.alpha` makes the drift significant; `drift.retrain_from_pretrained` decides whether that
sends the retraining back to pretrained weights instead of fine-tuning the champion (the flow records why).
Hand-written: no library here offers an MMD permutation test over torch embeddings (torchmetrics has none).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xbn.config import Params
from xbn.data.snapshot import diff_files, diff_line
from xbn.utils.io import file_digest, write_json, write_text

log = logging.getLogger(__name__)
MIN_SAMPLE = 8  # fewer new images than this: no two-sample test (it could not reject anything)
TOP_CLASSES = 10


def drift_report(params: Params, checkpoint: str | Path, champion_version: int, before: pd.DataFrame,
                 after: pd.DataFrame, profile_before: dict | None = None,
                 profile_after: dict | None = None) -> dict[str, Any]:
    """Compare the champion's data table `before` with the current `after` (`reports/data_files.parquet`
    tables), embedding samples with the champion's `checkpoint`; writes `drift.report` and its Markdown."""
    cfg = params.drift
    diff = diff_files(before, after)
    report: dict[str, Any] = {
        "champion_version": champion_version,
        "images": {"champion": len(before), "now": len(after)},
        "classes": {"champion": int(before["label"].nunique()), "now": int(after["label"].nunique())},
        "changes": diff, "changes_line": diff_line(diff),
        "profile": {"champion": profile_before, "now": profile_after},
    }
    old, new = _samples(before, after, cfg.sample, cfg.seed)
    if len(new) < MIN_SAMPLE or len(old) < MIN_SAMPLE:
        report["embedding"] = {"tested": False, "reason": f"{len(new)} new or changed image(s), {len(old)} "
                               f"unchanged: at least {MIN_SAMPLE} of each are needed for a two-sample test"}
        report["significant"] = False
        figure_path(cfg.report).unlink(missing_ok=True)  # an earlier run's picture is not this one's
    else:
        x, x_labels, y, y_labels = _embed(params, checkpoint, old, new)
        mmd2, null = mmd_null(x, y, cfg.permutations, cfg.seed)
        p_value = p_value_of(mmd2, null)
        from xbn.tracking.plots import plot_drift  # matplotlib only when there is something to draw

        plot_drift(mmd2, null, p_value, cfg.alpha, x, y, figure_path(cfg.report))
        report["embedding"] = {"tested": True, "statistic": "MMD^2 (RBF kernel, median heuristic)",
                               "mmd2": mmd2, "p_value": p_value, "old_images": len(x),
                               "new_images": len(y), "permutations": cfg.permutations, "alpha": cfg.alpha,
                               "figure": figure_path(cfg.report).name}
        report["class_shift"] = class_shift(x, x_labels, y, y_labels)
        report["significant"] = bool(p_value < cfg.alpha)
    report["line"] = drift_line(report)
    write_json(cfg.report, report)
    write_text(Path(cfg.report).with_suffix(".md"), drift_markdown(report))
    log.info("drift vs champion v%d: %s", champion_version, report["line"])
    return report


def _samples(before: pd.DataFrame, after: pd.DataFrame, size: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Seeded samples of the unchanged images (same path and bytes as the champion's) and of the new ones."""
    merged = after.merge(before[["path", "md5"]], on="path", how="left", suffixes=("", "_before"))
    # Nullable comparisons: a new path has no md5 before (NA), which must count as "not the same".
    same = (merged["md5"] == merged["md5_before"]).fillna(False).astype(bool)
    rng = np.random.default_rng(seed)

    def pick(frame: pd.DataFrame) -> pd.DataFrame:
        rows: np.ndarray | list[int] = (rng.choice(len(frame), size=min(size, len(frame)), replace=False)
                                        if len(frame) else [])
        return frame.iloc[np.sort(rows)][["path", "label"]]

    return pick(merged[same]), pick(merged[~same])


def _embed(params: Params, checkpoint: str | Path, old: pd.DataFrame, new: pd.DataFrame):
    import torch

    from xbn.evaluation.embed import embed_split
    from xbn.evaluation.engine import engined
    from xbn.evaluation.inference import inference_mode
    from xbn.evaluation.served import model_engine
    from xbn.models import load_embedder

    model, data_config, _ = load_embedder(checkpoint, map_location="cpu", verify=False)  # checked on download
    mode = inference_mode(params, model, torch.device("cpu"))
    network = engined(model, model_engine(model, data_config, params.data.image_size, file_digest(checkpoint), "cpu",
                                          params.inference.engine))
    frame = pd.concat([old.assign(split="old"), new.assign(split="new")], ignore_index=True)
    codes = dict(enumerate(sorted(frame["label"].unique())))  # embed_split's label codes: the sorted labels
    out = []
    for split in ("old", "new"):
        emb, labels = embed_split(network, frame, params.data.root, split, image_size=params.data.image_size,
                                  mean=data_config["mean"], std=data_config["std"],
                                  batch_size=params.eval.batch_size, num_workers=0, device=torch.device("cpu"),
                                  mode=mode)
        out += [np.asarray(emb, dtype=np.float64), np.array([codes[int(c)] for c in labels])]
    return tuple(out)


def figure_path(report: str | Path) -> Path:
    """The drift report's figure (`plot_drift`), beside its JSON."""
    return Path(report).with_suffix(".png")


def mmd_permutation_test(x: np.ndarray, y: np.ndarray, permutations: int, seed: int) -> tuple[float, float]:
    """Unbiased MMD^2 between samples x and y with an RBF kernel whose bandwidth is the median pairwise
    distance of the pooled sample, and its permutation p-value ((1 + #{perm >= observed}) / (1 + perms))."""
    observed, null = mmd_null(x, y, permutations, seed)
    return observed, p_value_of(observed, null)


def p_value_of(observed: float, null: np.ndarray) -> float:
    return (1 + int((null >= observed).sum())) / (1 + len(null))


def mmd_null(x: np.ndarray, y: np.ndarray, permutations: int, seed: int) -> tuple[float, np.ndarray]:
    """The observed MMD^2 (`mmd_permutation_test`) and its `permutations` values under random relabellings of
    the pooled sample: the null distribution the p-value and the drift figure come from."""
    z = np.concatenate([x, y])
    # Squared distances from the Gram matrix, |a|^2 + |b|^2 - 2 a.b: [N, N], not the [N, N, d] differences
    # (16 GiB at drift.sample 1000 and d 512). Clipped at 0 against rounding.
    norms = np.einsum("ij,ij->i", z, z)
    squared = np.maximum(norms[:, None] + norms[None, :] - 2.0 * (z @ z.T), 0.0)
    np.fill_diagonal(squared, 0.0)
    off_diagonal = squared[np.triu_indices(len(z), 1)]
    bandwidth = float(np.median(off_diagonal)) or 1.0
    kernel = np.exp(-squared / bandwidth)
    n = len(x)

    def mmd2(order: np.ndarray) -> float:
        k = kernel[np.ix_(order, order)]
        kxx, kyy, kxy = k[:n, :n], k[n:, n:], k[:n, n:]
        m = len(order) - n
        return float((kxx.sum() - np.trace(kxx)) / (n * (n - 1)) + (kyy.sum() - np.trace(kyy)) / (m * (m - 1))
                     - 2 * kxy.mean())

    observed = mmd2(np.arange(len(z)))
    rng = np.random.default_rng(seed)
    return observed, np.array([mmd2(rng.permutation(len(z))) for _ in range(permutations)])


def class_shift(x: np.ndarray, x_labels: np.ndarray, y: np.ndarray, y_labels: np.ndarray) -> list[dict]:
    """For each class with images on both sides: 1 - cosine similarity of the two centroids, largest first."""
    shifts: list[dict[str, Any]] = []
    for label in sorted(set(x_labels) & set(y_labels)):
        a, b = x[x_labels == label].mean(0), y[y_labels == label].mean(0)
        cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))
        shifts.append({"class": str(label), "shift": round(1 - cosine, 6), "old_images": int((x_labels == label).sum()),
                       "new_images": int((y_labels == label).sum())})
    return sorted(shifts, key=lambda s: -s["shift"])[:TOP_CLASSES]


def drift_line(report: dict[str, Any]) -> str:
    emb = report["embedding"]
    test = (f"MMD^2 {emb['mmd2']:.4f}, p = {emb['p_value']:.3f} ({'significant' if report['significant'] else 'not significant'} "
            f"at {emb['alpha']:g})" if emb["tested"] else f"no embedding test ({emb['reason']})")
    return f"vs champion v{report['champion_version']}: {report['changes_line']}; {test}"


def drift_markdown(report: dict[str, Any]) -> str:
    lines = [f"# Drift against champion v{report['champion_version']}", "", report["line"], "",
             "| | champion's data | now |", "|---|---:|---:|",
             f"| images | {report['images']['champion']} | {report['images']['now']} |",
             f"| classes | {report['classes']['champion']} | {report['classes']['now']} |", ""]
    for key, part in report["changes"].items():
        if isinstance(part, dict) and part["count"]:
            lines.append(f"- {key.replace('_', ' ')}: {part['count']} (e.g. {', '.join(part['examples'])})")
    profile = report["profile"]
    if profile["champion"] and profile["now"]:
        lines += ["", "## Images (validation profile)", "", "| | champion's data | now |", "|---|---|---|"]
        for key in ("width", "height", "mode"):
            lines.append(f"| {key} | {profile['champion'].get(key)} | {profile['now'].get(key)} |")
    if figure := report["embedding"].get("figure"):
        lines += ["", f"![the permutation null with the observed MMD², and the embeddings projected]({figure})"]
    if report.get("class_shift"):
        lines += ["", "## Largest class shifts (1 - cosine of the centroids, unchanged vs new images)", "",
                  "| class | shift | unchanged | new |", "|---|---:|---:|---:|"]
        lines += [f"| {s['class']} | {s['shift']:.4f} | {s['old_images']} | {s['new_images']} |"
                  for s in report["class_shift"]]
    return "\n".join(lines) + "\n"


__all__ = ["class_shift", "drift_line", "drift_report", "figure_path", "mmd_null", "mmd_permutation_test"]
