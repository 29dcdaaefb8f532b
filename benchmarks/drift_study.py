"""Issue 42's study rendered for docs/benchmarks.md: is it the regime or the method that keeps the memory's
gain small? From `grid --regime drift` (the grid's short schedule, batch 16 and 64) and `grid --regime
drift_long` (seed 000's Table 2 setting, scaled) on the SOP-like Omniglot split (benchmarks/regimes.py):

- every arm against `none`, paired by seed (95% t interval; a difference counts only when it excludes 0);
- the memory's own drift (seed 000 Fig. 2): the stored and the mapped rows against the current model's
  embedding of the same input, averaged over the run's checks, and a figure of it over training;
- the issue's decision rules, applied to those numbers.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import markdown_table

ARMS = ("xbm", "xbn", "oracle", "xbn_exclude_self", "xbn_half", "xbn_late", "xbm_late", "xbn*", "xbm*",
        "xbn_attached")
ABOUT = {
    "none": "no memory",
    "xbm": "XBM, memory loss alone",
    "xbn": "XBN (seed 000), memory loss alone",
    "oracle": "drift-free memory: rows re-embedded 8 times a turn",
    "xbn_exclude_self": "XBN, no stored view of the anchor's own image",
    "xbn_half": "XBN, memory of half the training set",
    "xbn_late": "XBN joining late",
    "xbm_late": "XBM joining late",
    "xbn*": "XBN + the minibatch loss (shipped)",
    "xbm*": "XBM + the minibatch loss (XBM*)",
    "xbn_attached": "XBN, the batch's rows attached (two-sided gradient), no minibatch loss",
}


def _cell(d: dict[str, Any] | None) -> str:
    if d is None:
        return "-"
    text = f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
    return f"**{text}**" if d["low"] > 0 or d["high"] < 0 else text


def _runs(data: dict[str, Any], batch: int, method: str) -> list[dict[str, Any]]:
    return [r for r in data["runs"] if r["batch"] == batch and r["method"] == method and "recall@1" in r]


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def drift_row(data: dict[str, Any], batch: int, method: str) -> dict[str, Any] | None:
    """The run-level drift summaries of `method`, averaged over its seeds, with the series' batch-mean noise
    and the map's scale range (over every check)."""
    runs = [r for r in _runs(data, batch, method) if r.get("memory_drift")]
    if not runs:
        return None
    row = {k: _mean([r["memory_drift"][k] for r in runs]) for k in runs[0]["memory_drift"] if k != "checks"}
    columns = runs[0]["drift_columns"]
    series = [dict(zip(columns, s)) for r in runs for s in r["drift_series"]]
    row["batch_mean_noise"] = _mean([s["batch_mean_noise"] for s in series])
    lows, highs = [s["scale_min"] for s in series if s["scale_min"]], [s["scale_max"] for s in series if s["scale_max"]]
    row["scale"] = f"{min(lows):.2f} to {max(highs):.2f}" if lows else "-"
    return row


def figure(regimes: list[tuple[str, dict[str, Any], int]], path: Path) -> Path:
    """Seed 000's Fig. 2 form: the mean distance of XBM's stored rows, XBN's stored and mapped rows and the
    oracle's rows to fresh embeddings of the same inputs, over training (mean over seeds), one panel per
    regime and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from xbn.utils.io import atomic_path

    fig, axes = plt.subplots(1, len(regimes), figsize=(5.2 * len(regimes), 3.6), squeeze=False)
    for ax, (title, data, batch) in zip(axes[0], regimes):
        for method, column, label, colour in (("xbm", "stored_drift_mean", "XBM rows", "C0"),
                                              ("xbn", "stored_drift_mean", "XBN rows as written", "C1"),
                                              ("xbn", "mapped_drift_mean", "XBN rows mapped (Eq. 6)", "C2"),
                                              ("oracle", "stored_drift_mean", "oracle rows", "C3")):
            by_iteration: dict[int, list[float]] = {}
            for run in _runs(data, batch, method):
                for s in run.get("drift_series", []):
                    s = dict(zip(run["drift_columns"], s))
                    by_iteration.setdefault(int(s["iteration"]), []).append(s[column])
            if by_iteration:
                its = sorted(by_iteration)
                ax.plot(its, [statistics.mean(by_iteration[i]) for i in its], label=label, color=colour)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel("distance to a fresh embedding")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path


def decisions(short: dict[str, Any] | None, long: dict[str, Any] | None, paired) -> list[str]:
    """The issue's rules, each applied where its arms ran; `paired(data, batch, method)` is the paired
    difference to `none`."""
    out = []
    for name, data, batches in (("short", short, (16, 64)), ("long", long, (64,))):
        if data is None:
            continue
        for batch in batches:
            d = {m: paired(data, batch, m) for m in ARMS if _runs(data, batch, m)}
            if "oracle" not in d or d["oracle"] is None:
                continue
            where = f"{name} regime, batch {batch}"
            oracle = d["oracle"]
            if oracle["low"] <= 0:  # not beyond the seed spread
                out.append(f"- {where}: oracle {_cell(oracle)} against none: a drift-free memory does not beat "
                           "no memory, so **no drift correction can help here**.")
            else:
                xbn, xbm = d.get("xbn"), d.get("xbm")
                same = xbn and xbm and abs(xbn["mean"] - xbm["mean"]) < max(xbn["high"] - xbn["mean"], 0.01)
                out.append(f"- {where}: oracle {_cell(oracle)} beats none" + (
                    "; xbn and xbm agree, so **the map does not correct this drift**." if same else "."))
            if (e := d.get("xbn_exclude_self")) and e["low"] >= 0 and d.get("xbn") and d["xbn"]["high"] < 0:
                out.append(f"- {where}: exclude_self {_cell(e)} against xbn {_cell(d['xbn'])}: stale "
                           "self-positives are the cause.")
            star, plain, attached = d.get("xbn*"), d.get("xbn"), d.get("xbn_attached")
            if star and plain and star["low"] > 0 > plain["high"]:
                text = (f"- {where}: xbn + the minibatch loss {_cell(star)} > none > xbn {_cell(plain)}")
                if attached and attached["high"] < 0:
                    text += (f"; but the attached rows (two-sided gradient, no minibatch loss) {_cell(attached)} do "
                             "not rescue it, so it is the minibatch loss itself, **not the one-sided gradient**, "
                             "that the memory needs.")
                out.append(text + ("." if not text.endswith(".") else ""))
    return out


def targets(short: dict[str, Any] | None, long: dict[str, Any] | None, paired) -> list[dict[str, Any]]:
    """The issue's two targets: xbn >= none + 0.02 test R@1 in the long regime, the 95% paired interval above 0;
    and Fig. 2's ordering (the mapped rows nearer fresh embeddings than the stored ones for most of training)."""
    found = []
    if long and _runs(long, 64, "xbn"):
        d = paired(long, 64, "xbn")
        found.append({"what": "long regime, batch 64: xbn - none test R@1, 95% paired interval above 0",
                      "at_least": 0.02, "value": _cell(d).strip("*"),
                      "verdict": "met" if d and d["mean"] >= 0.02 and d["low"] > 0 else "missed",
                      "file": long["_file"]})
    for title, data, batch in (("short, batch 16", short, 16), ("short, batch 64", short, 64),
                               ("long, batch 64", long, 64)):
        if data and (row := drift_row(data, batch, "xbn")):
            found.append({"what": f"{title}: share of drift checks where XBN's mapped rows are nearer fresh "
                                  "embeddings than the stored ones (Fig. 2)", "at_least": 0.5,
                          "value": f"{row['mapped_closer_fraction']:.2f}",
                          "verdict": "met" if row["mapped_closer_fraction"] > 0.5 else "missed",
                          "file": data["_file"]})
    return [t | {"section": "14"} for t in found]


def render(short: dict[str, Any] | None, long: dict[str, Any] | None, header, paired_difference,
           docs: Path, cpu: dict[str, Any] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The section and its targets; `header(data)` and `paired_difference(runs, dataset, batch, method,
    baseline)` are report.py's. `cpu`: the same short regime re-run on the CPU machine (a subset of the arms,
    more seeds), a column of its own (runs pair only within one machine)."""
    regimes = [(f"short, batch {b}", short, b) for b in (16, 64) if short] + (
        [("long, batch 64", long, 64)] if long else []) + (
        [(f"short, batch 64, CPU ({len({r['seed'] for r in cpu['runs']})} seeds)", cpu, 64)] if cpu else [])

    def paired(data, batch, method):
        dataset = data["runs"][0]["dataset"]
        return paired_difference(data["runs"], dataset, batch, method, "none")

    out = ["## 14. Is it the regime or the method? The memory's drift (issue 42)", "",
           "The SOP-like split of Omniglot: all 964 characters, 5 drawings each, class-disjoint halves (about 410 "
           "training classes after 72 go to validation, 482 test classes), 64 px, the shipped params otherwise. "
           "**Short**: the grid's 1 + 4 epochs, memory = the training set, joining after the head warm-up. "
           "**Long**: 1 + 48 epochs at batch 64, the lr ×0.33 every 15, a memory of half the training set "
           "joining 1,000 steps after the warm-up and turning over 30 times. Every arm at every seed; each "
           "cell is test R@1 minus `none`'s, paired by seed, with its 95% interval (bold: it excludes 0). "
           "Arms without a star take the memory loss alone (seed 000's XBN); the late start joins after 2 of "
           "the 4 epochs in the short regime (it has fewer than 1,000 steps after the warm-up).", ""]
    for data in (short, long, cpu):
        if data:
            gpus = sorted({r["gpu"] for r in data["runs"] if r.get("gpu")})
            out += [header({**data, "gpu": ", ".join(gpus) or None}), ""]
    rows = []
    for method in ("none", *ARMS):
        cells = []
        for _, data, batch in regimes:
            runs = _runs(data, batch, method)
            if not runs:
                cells.append("-")
            elif method == "none":
                cells.append(f"{statistics.mean(r['recall@1'] for r in runs):.3f} ({len(runs)} seeds)")
            else:
                cells.append(_cell(paired(data, batch, method)))
        rows.append([f"`{method}`: {ABOUT[method]}", *cells])
    out += [markdown_table(["arm", *(t for t, _, _ in regimes)], rows), ""]
    collapsed = [f"{title}: {m} ({n} of {len(_runs(data, batch, m))} seeds)" for title, data, batch in regimes
                 for m in ARMS if (n := sum(r["best_epoch"] <= 1 for r in _runs(data, batch, m)))]
    if collapsed:
        out += ["Runs whose selected checkpoint is the head warm-up's (no later epoch beat it on validation R@1: "
                "training with the memory made the model worse from its first epoch on, and the row is the "
                "warm-up model): " + "; ".join(collapsed) + ".", ""]

    drift_rows = []
    for title, data, batch in regimes:
        for method in ARMS:
            if row := drift_row(data, batch, method):
                drift_rows.append([title, method, f"{row['stored_drift_mean']:.3f}", f"{row['mapped_drift_mean']:.3f}",
                                   f"{row['stored_cosine']:.4f}", f"{row['mapped_cosine']:.4f}",
                                   f"{row['memory_age']:.1f}", f"{row['mapped_closer_fraction']:.2f}",
                                   f"{row['batch_mean_noise']:.4f}" if row["batch_mean_noise"] else "-", row["scale"]])
    fig = figure(regimes, docs / "drift_fig2.png")
    out += ["The memory's drift (seed 000 Sec. 5, Fig. 2), every 20 steps on 256 fixed memory slots: the distance "
            "between a stored row and the current model's embedding of the same augmented view, for the row as "
            "written (`stored`, what XBM uses) and as the loss sees it after the maps (`mapped`), averaged over "
            "the run's checks and the seeds; `age`: the rows' mean age in steps; `closer`: the share of checks "
            "where the mapped rows were nearer the fresh embeddings than the stored ones; `noise`: the spread of "
            "the per-dimension batch mean between checks (what Eq. 6's target carries); `scale`: the map's "
            f"per-dimension scale, lowest to highest. Figure: `{fig.relative_to(docs.parent)}`.", "",
            markdown_table(["regime", "arm", "stored dist.", "mapped dist.", "stored cos", "mapped cos", "age",
                            "closer", "noise", "scale"], drift_rows), ""]
    found = decisions(short, long, paired)
    if found:
        out += ["What the issue's rules say, applied to these numbers:", "", *found, ""]
    return "\n".join(out), targets(short, long, paired)
