"""Docs section 15 (issue 52): why a drift-free memory collapsed, and the memory arms measured again with the fix.

Two kinds of results file, both written by `python -m benchmarks grid --regime drift` with the memory path's step
figures on (`--set train.log_every=8`):
- the mechanism (`collapse_mechanism*.json`): one seed, one arm per candidate cause (`--arm`), each with its
  `figure_series`: what the batch and the memory did from the step the memory joined;
- the grid (`grid_collapse.json`): every memory arm beside its `none` on one machine and commit, several seeds.
Every number below is computed here from those files."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

# What each arm of the mechanism files changes, as the table says it (arms not listed show their name only).
ARM_CHANGES = {
    "none": "no memory",
    "xbm": "XBM, memory loss alone, no-positive fallback",
    "xbm_zero": "XBM, PML's exact 0 when no positive is mined (`loss.no_positive=zero`): the old path",
    "oracle": "drift-free memory (rows re-embedded 8 times a turn), fallback",
    "oracle_zero": "drift-free memory, the old path",
    "xbn": "XBN (rows mapped onto the batch's moments), fallback",
    "xbn_zero": "XBN, the old path",
    "xbm_nominer": "XBM, no miner (`loss.miner=null`)",
    "xbm_xbmloss": "XBM, the official XBM contrastive loss, no miner",
    "xbm_center": "XBM, the memory loss's gradient centred over the batch (`memory.center_gradient`)",
    "oracle_center": "drift-free memory, centred gradient",
    "oracle_nominer": "drift-free memory, no miner",
    "xbn_center": "XBN, centred gradient",
    # round 3 (`mech_b16_r3.json`): the miner off against the memory only (`memory.mine=false`)
    "xbn*": "XBN + the minibatch loss: the shipped default (gradient not centred)",
    "xbn_all": "XBN, all pairs against the memory (`memory.mine=false`)",
    "xbn*_all": "the shipped default, all pairs against the memory",
    "xbm_all": "XBM, all pairs against the memory, centred gradient",
    "oracle_all": "drift-free memory, all pairs against the memory, centred gradient",
    "oracle_all_plain": "drift-free memory, all pairs against the memory, gradient not centred",
    # the 8-epoch probe (`mech_b16_e8.json`) and the grid (`grid_fix.json`)
    "xbn_c": "XBN, centred gradient",
    "xbm_c": "XBM, centred gradient",
    "oracle_c": "drift-free memory, centred gradient",
    # Omniglot (`mech_omniglot_b16.json`): is XBM starved of negatives by drift? All pairs against its memory
    "xbm_c_all": "XBM, centred gradient, all pairs against the memory (`memory.mine=false`): no negative starved",
    # every method unstarved (`grid_omniglot_arms.json`)
    "oracle_c_all": "drift-free memory, centred gradient, all pairs against the memory",
    "xbn_c_all": "XBN, centred gradient, all pairs against the memory",
    "axbn_c_all": "AXBN (Kalman-filtered moments), centred gradient, all pairs against the memory",
    # sop_like (`grid_sop_arms.json`): is an anchor's own stored copy (a large share of 5 images a class) the cost?
    "xbm_c_all_xs": "`xbm_c_all` with `memory.exclude_self=true`: an anchor never meets its own stored copy",
    "xbm*": "XBM + the minibatch loss (the miner's pairs, gradient not centred, as the shipped default)",
    "axbn*": "AXBN + the minibatch loss (otherwise the shipped default)",
    # should the gradient be centred by default? (`grid_sop_arms.json` at batch 16, `grid_center.json` at 64)
    "xbn*_c": "the shipped default with the memory loss's gradient centred (`memory.center_gradient: true`)",
    "xbm*_c": "XBM + the minibatch loss, gradient centred",
}
# The arms the targets compare: `grid_fix.json`'s names, `grid_collapse.json`'s, then the unstarved arms of
# `grid_omniglot_arms.json` (a grid holds one of each).
ORACLE_ARMS, XBN_ARMS, XBM_ARMS = (("oracle_c", "oracle", "oracle_c_all"), ("xbn_c", "xbn", "xbn_c_all"),
                                   ("xbm_c", "xbm", "xbm_c_all"))
MIN_SEEDS = 3  # a comparison over fewer paired seeds is shown, and judged inconclusive


def _judged(d: dict[str, Any], met: bool) -> str:
    return ("met" if met else "missed") if d["seeds"] >= MIN_SEEDS else "inconclusive"
# Step offsets after the memory joins at which the mechanism table reads the batch's figures.
AFTER = 40


def _series(run: dict[str, Any]) -> list[dict[str, float]]:
    columns = run.get("figure_columns") or []
    return [dict(zip(columns, row)) for row in run.get("figure_series", [])]


def _at(series: list[dict[str, float]], step: int) -> dict[str, float] | None:
    later = [r for r in series if r["iteration"] >= step]
    return later[0] if later else None


def mechanism_rows(data: dict[str, Any]) -> list[list[str]]:
    rows = []
    for run in data["runs"]:
        if "recall@1" not in run:
            continue
        series = _series(run)
        joined = series[0]["iteration"] if series else None
        start = series[0] if series else None
        later = _at(series, joined + AFTER) if joined is not None else None
        tail = series[-len(series) // 4:] if series else []
        no_positive = statistics.mean(r["memory_no_positive"] for r in tail if r.get("memory_no_positive") is not None) \
            if tail and any(r.get("memory_no_positive") is not None for r in tail) else None

        starved = statistics.mean(r["memory_negatives"] < 1 for r in tail
                                  if r.get("memory_negatives") is not None) \
            if tail and any(r.get("memory_negatives") is not None for r in tail) else None

        def fig(row, key):
            return f"{row[key]:.3f}" if row and row.get(key) is not None else ""

        rows.append([f"`{run['method']}`", ARM_CHANGES.get(run["method"], ""), f"{run['recall@1']:.3f}",
                     str(run["best_epoch"]), str(run.get("collapse_iteration") or "never"),
                     f"{fig(start, 'batch_cosine')} → {fig(later, 'batch_cosine')}" if start else "",
                     f"{fig(start, 'batch_memory_cosine')} → {fig(later, 'batch_memory_cosine')}" if start else "",
                     f"{no_positive:.2f}" if no_positive is not None else "",
                     f"{starved:.2f}" if starved is not None else ""])
    return rows


def figure_rows(data: dict[str, Any]) -> list[list[str]]:
    """Per memory arm and batch, over the second half of training (mean over its seeds): what the memory path
    mined, where the batch sat against the memory, and the validation R@1 at the warm-up and at the end."""
    rows = []
    arms = dict.fromkeys((r["batch"], r["method"]) for r in data["runs"] if r["method"] != "none")
    for batch, method in sorted(arms, key=lambda a: a[0]):
        halves, curves = [], []
        for run in data["runs"]:
            if (run["batch"], run["method"]) == (batch, method) and (series := _series(run)):
                halves.append(series[len(series) // 2:])
                curves.append(run.get("val_curve") or [])
        if not halves:
            continue

        def mean(key: str) -> float:
            return statistics.mean(statistics.mean(r[key] for r in half if r.get(key) is not None)
                                   for half in halves)

        starved = statistics.mean(sum(r["memory_negatives"] < 1 for r in half) / len(half) for half in halves)
        val = (f"{statistics.mean(c[1] for c in curves):.3f} → {statistics.mean(c[-1] for c in curves):.3f}"
               if all(len(c) > 1 for c in curves) else "")
        rows.append([f"`{method}`", str(batch), str(len(halves)), f"{mean('memory_negatives'):,.1f}",
                     f"{mean('memory_positives'):,.1f}", f"{starved:.2f}", f"{mean('batch_memory_cosine'):.3f}",
                     f"{mean('batch_cosine'):.3f}", val])
    return rows


def grid_rows(data: dict[str, Any], batch: int, paired) -> tuple[list[list[str]], dict[str, Any]]:
    dataset = data["runs"][0]["dataset"]
    methods = list(dict.fromkeys(r["method"] for r in data["runs"] if r["batch"] == batch))
    rows, diffs = [], {}
    warmup = data["settings"]["scales"][dataset]["warmup_epochs"]
    for method in methods:
        runs = [r for r in data["runs"] if r["batch"] == batch and r["method"] == method and "recall@1" in r]
        if not runs:
            continue
        values = [r["recall@1"] for r in runs]
        d = paired(data["runs"], dataset, batch, method, "none") if method != "none" else None
        diffs[method] = d
        at_warmup = sum(r["best_epoch"] <= warmup for r in runs)
        collapsed = sum(r.get("collapse_iteration") is not None for r in runs)
        rows.append([f"`{method}`", str(len(runs)),
                     f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else
                     f"{values[0]:.3f}",
                     (f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]" if d else ""),
                     ", ".join(str(r["best_epoch"]) for r in sorted(runs, key=lambda r: r["seed"])),
                     f"{at_warmup}", f"{collapsed}"])
    return rows, diffs


def targets(grid: dict[str, Any], diffs: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 52's targets that the grid can judge: no memory arm ends at its warm-up checkpoint; the oracle (memory
    loss alone) >= none - 0.01 on the paired mean at each batch; XBN > XBM (memory loss alone) at batch 16 with
    the interval above 0."""
    dataset = grid["runs"][0]["dataset"]
    warmup = grid["settings"]["scales"][dataset]["warmup_epochs"]
    memory_runs = [r for r in grid["runs"] if r["method"] != "none" and "best_epoch" in r]
    stuck = [f"{r['method']} b{r['batch']} s{r['seed']}" for r in memory_runs if r["best_epoch"] <= warmup]
    found = [{"what": f"{dataset}: runs of a memory arm whose best epoch is the warm-up's (of {len(memory_runs)})",
              "at_most": 0, "value": str(len(stuck)) + (f" ({', '.join(stuck)})" if stuck else ""),
              "verdict": "met" if not stuck else "missed"}]
    for batch, d in sorted(diffs.items()):
        if (oracle := next((d[a] for a in ORACLE_ARMS if d.get(a) is not None), None)) is not None:
            found.append({"what": f"{dataset}, batch {batch}: oracle (memory loss alone) - none, paired mean",
                          "at_least": -0.01, "value": f"{oracle['mean']:+.3f} [{oracle['low']:+.3f}, "
                                                      f"{oracle['high']:+.3f}]",
                          "verdict": _judged(oracle, oracle["mean"] >= -0.01)})
    return [t | {"section": "15", "file": grid["_file"]} for t in found]


def xbn_over_xbm(grid: dict[str, Any], paired, batch: int = 16) -> dict[str, Any] | None:
    """XBN - XBM (memory loss alone), paired, with `untrained`: the arms' runs that never beat their warm-up
    checkpoint (an arm that did not train is no evidence for the ordering)."""
    dataset = grid["runs"][0]["dataset"]
    methods = {r["method"] for r in grid["runs"]}
    xbn = next((a for a in XBN_ARMS if a in methods), None)
    xbm = next((a for a in XBM_ARMS if a in methods), None)
    d = paired(grid["runs"], dataset, batch, xbn, xbm) if xbn and xbm else None
    if d is not None:
        warmup = grid["settings"]["scales"][dataset]["warmup_epochs"]
        d["untrained"] = [f"{r['method']} s{r['seed']}" for r in grid["runs"] if r["method"] in (xbn, xbm)
                          and r["batch"] == batch and r.get("best_epoch", warmup + 1) <= warmup]
    return d


def best_small_over_large_none(grid: dict[str, Any], paired, small: int = 16, large: int = 64
                               ) -> tuple[str, dict[str, Any]] | None:
    """The seed's promise: the best memory arm at batch `small` (by its mean test R@1) against `none` at batch
    `large`, paired by seed. The arm is chosen on the same runs it is judged on, as the target words it."""
    dataset = grid["runs"][0]["dataset"]
    done = [r for r in grid["runs"] if "recall@1" in r]
    arms = {r["method"] for r in done if r["batch"] == small and r["method"] != "none"}
    if not arms or not any(r["batch"] == large and r["method"] == "none" for r in done):
        return None
    best = max(sorted(arms), key=lambda a: statistics.mean(
        r["recall@1"] for r in done if r["batch"] == small and r["method"] == a))
    large_none = [{**r, "batch": small, "method": f"none_b{large}"} for r in done
                  if r["batch"] == large and r["method"] == "none"]
    d = paired([r for r in done if r["batch"] == small] + large_none, dataset, small, best, f"none_b{large}")
    return (best, d) if d is not None else None


GRID_NOTES = {
    "grid_collapse": "`memory.center_gradient: true` and `loss.no_positive: all_pairs` in every memory arm, `xbn*` "
                     "included (the defaults at the commit the grid ran). `memory.center_gradient` is off by "
                     "default for XBN and AXBN since: `xbn*` lost to `none` here with it (`auto`, the default, "
                     "centres XBM and the oracle only: `grid_sop_arms.json` and `grid_center.json`).",
    "grid_fix": "The shipped default `xbn*` as shipped (gradient not centred), and the memory loss alone with the "
                "gradient centred (`_c`: without it XBM and the oracle contract onto one point, as above); "
                "`loss.no_positive: all_pairs` everywhere. On another machine than `grid_collapse.json`, so no run is "
                "bit-identical to that file's (`none` included).",
    "grid_fix_omniglot": "`grid_fix.json`'s arms on Omniglot at 64 px (306 training classes of 20 drawings, 1 + 4 "
                         "epochs), without the oracle (three times the others' cost): the memory loss alone "
                         "(`_c`, centred), the shipped default `xbn*` and `none` at batch 16; `none` and `xbn*` "
                         "at batch 64 join with `--resume --batches 64 --methods none xbn*`.",
    "grid_all_b64": "At the shipped batch of 64, on both sets: XBM's memory loss alone with every pair against the "
                    "memory (centred, `xbm_c_all`), the shipped default `xbn*` and `none`, all at one commit on one "
                    "machine.",
    "grid_all_omniglot": "Is XBM starved of negatives by drift? Its memory loss alone (centred) with the miner's "
                         "pairs against the memory (`xbm_c`) and with every pair (`xbm_c_all`, "
                         "`memory.mine=false`: no negative can be starved), XBN with every pair (`xbn_c_all`), and "
                         "`none`, on Omniglot at batch 16, all at one commit on one machine.",
    "grid_omniglot_arms": "Every memory method with its memory loss alone, unstarved (centred gradient, every pair "
                          "against the memory: `xbm_c_all`'s settings), beside `none`, on Omniglot at batch 16, 5 "
                          "seeds, then `none` and `xbm_c_all` at batch 64 (`--resume --batches 64`, at the next "
                          "commit), then `oracle_c_all` at batch 64 (`--resume`, at the commit after, which only "
                          "added results; neither change touches training), on one machine. The oracle re-embeds "
                          "every stored row every `memory.oracle_every` steps: a memory with no drift, otherwise "
                          "XBM's.",
    "grid_sop_arms": "The Omniglot grid's unstarved arms (centred gradient, every pair against the memory) on the "
                     "product-search-like split at batch 16, beside `none`, 3 seeds, then seeds 3 and 4 and AXBN "
                     "(`--resume`), all at one commit on one machine: does the memory's loss alone still lose to "
                     "no memory there once the miner cannot starve it, and does a memory with no drift? Then "
                     "`xbm_c_all_xs` (`--resume`, at the next commit, which only added results): is an anchor's "
                     "own stored copy what it costs? Then each memory with the minibatch loss beside it, as "
                     "shipped (`xbn*`, `xbm*`, `axbn*`; `--resume` at the commit after, results only again). "
                     "Then the same two with the memory loss's gradient centred (`xbn*_c`, `xbm*_c`; `--resume` "
                     "at a later commit whose changes since touch no training code).",
    "grid_center": "Should the memory loss's gradient be centred by default? At the shipped batch of 64 on the "
                   "product-search-like split, then on Omniglot (`--resume`), 5 seeds, one commit and machine: the shipped default (`xbn*`) and "
                   "XBM with the minibatch loss (`xbm*`), each as shipped and centred (`_c`), beside `none`.",
    "grid_all_omniglot5": "`grid_all_omniglot.json`'s finding on 5 seeds, on another machine (an AVX2 EPYC) and "
                          "commit: XBM's memory loss alone with every pair against the memory (centred, "
                          "`xbm_c_all`) against `none`, on Omniglot at batch 16, all at one commit on one machine.",
}


def grid_tables(grid: dict[str, Any], diffs: dict[int, dict[str, Any]], paired_difference) -> list[str]:
    """A grid's tables: each batch's arms against `none` (filling `diffs`), then the memory path's figures."""
    dataset, out = grid["runs"][0]["dataset"], []
    for batch in sorted({r["batch"] for r in grid["runs"]}):
        rows, diffs[batch] = grid_rows(grid, batch, paired_difference)
        out += [f"{dataset}, batch {batch}: test R@1 mean ± std over seeds; the paired difference to `none` "
                "with its 95% interval; each seed's best epoch; how many seeds ended at the warm-up's "
                "checkpoint, and how many collapsed.", "",
                _table(["arm", "seeds", "test R@1", "− none", "best epochs", "at warm-up", "collapsed"], rows),
                ""]
    if figures := figure_rows(grid):
        out += ["The memory path over the second half of training, mean over seeds: pairs mined against the "
                "memory per logged step (negatives, positives); the share of steps that mined less than one "
                "negative; the cosine between the batch's mean and the memory's; the batch's mean pairwise "
                "cosine; validation R@1 at the warm-up's end → the last epoch.", "",
                _table(["arm", "batch", "seeds", "memory negatives", "memory positives", "steps < 1 negative",
                        "batch · memory", "batch cosine", "val R@1"], figures), ""]
    return out


# Paired contrasts between arms, by results file: the probes' (grids that test a mechanism over seeds and judge no
# target), and a judged grid's beyond its arms against `none`.
PROBE_CONTRASTS = {
    "grid_all_omniglot": (("xbm_c_all", "xbm_c", "XBM: every pair against the memory − the miner's"),
                          ("xbn_c_all", "xbm_c_all", "XBN − XBM, both with every pair against the memory")),
    "grid_all_b64": (("xbm_c_all", "xbn*", "XBM's memory loss alone with every pair − the shipped default"),),
    "grid_all_omniglot5": (),  # its one contrast, against `none`, is the grid table's
    "grid_omniglot_arms": (("oracle_c_all", "xbm_c_all", "what drift costs XBM: the drift-free memory − XBM"),
                           ("axbn_c_all", "xbn_c_all", "AXBN − XBN")),  # XBN − XBM: the target's line
    "grid_sop_arms": (("oracle_c_all", "xbm_c_all", "what drift costs XBM: the drift-free memory − XBM"),
                      ("xbm_c_all_xs", "xbm_c_all", "what an anchor's own stored copy costs XBM: without − with"),
                      ("xbn*_c", "xbn*", "centring the shipped default's memory gradient: centred − as shipped"),
                      ("xbm*_c", "xbm*", "centring XBM's memory gradient, minibatch loss beside: centred − not")),
    "grid_center": (("xbn*_c", "xbn*", "centring the shipped default's memory gradient: centred − as shipped"),
                    ("xbm*_c", "xbm*", "centring XBM's memory gradient, minibatch loss beside: centred − not")),
}


def probe_lines(grid: dict[str, Any], paired_difference) -> list[str]:
    dataset, out = grid["runs"][0]["dataset"], []
    for batch in sorted({r["batch"] for r in grid["runs"]}):
        for arm, base, what in PROBE_CONTRASTS.get(Path(grid["_file"]).stem, ()):
            if (d := paired_difference(grid["runs"], dataset, batch, arm, base)) is not None:
                out += [f"- {dataset}, {what} (`{arm}` − `{base}`), batch {batch}, paired: {d['mean']:+.3f} "
                        f"[{d['low']:+.3f}, {d['high']:+.3f}] over {d['seeds']} seeds.", ""]
    return out


def render(mechanism: list[dict[str, Any]], grids: list[dict[str, Any]], header, paired_difference,
           probes: list[dict[str, Any]] = ()) -> tuple[str, list[dict[str, Any]]]:
    """Section 15 and its targets (judged on the last of `grids`, the newest); `header` and `paired_difference`
    are report.py's."""
    out = ["## 15. Why a drift-free memory collapsed, and the memory arms again (issue 52)", "",
           "The SOP-like split of section 14, its short schedule (1 + 4 epochs, memory = the training set, joining "
           "after the head warm-up), the memory loss alone unless the arm's name has a `*`. Each run logs the "
           "memory path's figures every 8 steps (`metrics/train_steps.csv`, MLflow's step series): the memory "
           "loss, the pairs mined against the memory, the batch's mean pairwise cosine (`batch_cosine`: 1 when "
           "every image maps to one point) and the cosine between the batch's mean and the memory's "
           "(`batch_memory_cosine`). A run *collapsed* at the first logged step with `batch_cosine` ≥ 0.95.", ""]
    for data in sorted(mechanism, key=lambda d: d.get("started", "")):
        joins = sorted({int(series[0]["iteration"]) for run in data["runs"] if (series := _series(run))})
        out += [f"### The mechanism, one arm per candidate cause (`{data['_file']}`)", "",
                f"{data['runs'][0]['dataset']}, schedule 1 + {_epochs(data)} epochs, batch 16, seed 0.", "",
                header(data), "",
                "Columns: test R@1; the best epoch (1 is the warm-up's checkpoint: the arm never improved on it); "
                f"the collapse step (the memory's first logged step: {', '.join(map(str, joins)) or '-'}); "
                "`batch_cosine` and `batch_memory_cosine` when "
                f"the memory joined → {AFTER} steps later; the share of steps in the last quarter that mined no "
                "positive, and less than one negative, against the memory.", "",
                _table(["arm", "what it changes", "test R@1", "best epoch", "collapse step", "batch cosine",
                        "batch · memory", "no positive", "< 1 negative"], mechanism_rows(data)), ""]
    newest: dict[str, list[dict[str, Any]]] = {}  # per dataset, the newest grid's verdicts stand
    for grid in grids:
        dataset = grid["runs"][0]["dataset"]
        diffs: dict[int, dict[str, Any]] = {}
        out += ["### Every memory arm beside `none`, with the fix (`" + grid["_file"] + "`)", "",
                GRID_NOTES.get(Path(grid["_file"]).stem, ""), "", header(grid), ""]
        out += grid_tables(grid, diffs, paired_difference) + probe_lines(grid, paired_difference)
        found = targets(grid, diffs)
        if (d := xbn_over_xbm(grid, paired_difference)) is not None:
            out += [f"XBN − XBM (memory loss alone) at batch 16, paired: {d['mean']:+.3f} [{d['low']:+.3f}, "
                    f"{d['high']:+.3f}] over {d['seeds']} seeds.", ""]
            untrained = d["untrained"]
            if untrained:
                out += [f"Not evidence yet: {', '.join(untrained)} never beat the warm-up's checkpoint.", ""]
            found.append({"what": f"{dataset}, batch 16: XBN - XBM (memory loss alone), interval above 0",
                          "at_least": 0, "value": f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
                          + (f"; {', '.join(untrained)} did not train" if untrained else ""),
                          "verdict": "inconclusive" if untrained else _judged(d, d["low"] > 0), "section": "15",
                          "file": grid["_file"]})
        if (promise := best_small_over_large_none(grid, paired_difference)) is not None:
            arm, d = promise
            out += [f"The seed's promise on {dataset}: the best memory arm at batch 16 (`{arm}`, by its mean) − "
                    f"`none` at batch 64, paired by seed: {d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] over "
                    f"{d['seeds']} seeds.", ""]
            found.append({"what": f"{dataset}: best memory at batch 16 ({arm}) - none at batch 64, paired mean",
                          "at_least": 0, "value": f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]",
                          "verdict": _judged(d, d["mean"] >= 0), "section": "15",
                          "file": grid["_file"]})
        newest[dataset] = found
    for grid in probes:
        out += ["### The mechanism over seeds (`" + grid["_file"] + "`)", "", GRID_NOTES.get(Path(grid["_file"]).stem,
                ""), "", header(grid), ""]
        for dataset in dict.fromkeys(r["dataset"] for r in grid["runs"]):  # one dataset's runs at a time
            view = {**grid, "runs": [r for r in grid["runs"] if r["dataset"] == dataset]}
            out += [*grid_tables(view, {}, paired_difference), *probe_lines(view, paired_difference)]
    found = [t for dataset_targets in newest.values() for t in dataset_targets]
    return "\n".join(out) + "\n", found


def _epochs(data: dict[str, Any]) -> int:
    """The run's epochs after the warm-up: a `--set train.epochs=N`, else its dataset's schedule."""
    settings = data["settings"]
    for override in settings.get("overrides", []):
        if override.startswith("train.epochs="):
            return int(override.split("=", 1)[1])
    return int(settings["scales"][data["runs"][0]["dataset"]]["epochs"])


def _table(headers: list[str], rows: list[list[str]]) -> str:
    from benchmarks.common import markdown_table

    return markdown_table(headers, rows)
