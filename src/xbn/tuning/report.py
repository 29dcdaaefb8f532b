"""What a study leaves behind: a summary, the trials table, the plots and `params.tuned.yaml`, plus the merge
of the tuned values into a params file that keeps its comments."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from xbn.config import Params
from xbn.tuning.space import BATCH_KEY, LAMBDA, Dimension, SearchSpace, yaml_scalar
from xbn.tuning.study import BASELINE_ATTR, ERROR_ATTR, OBJECTIVE, WORKER_ATTR, StudySession
from xbn.utils.io import atomic_path, write_text

if TYPE_CHECKING:
    from matplotlib.axes import Axes

log = logging.getLogger(__name__)


def _value(t: FrozenTrial) -> float:
    """The objective of a complete trial (the only trials whose value is read here)."""
    assert t.value is not None, f"trial {t.number} ({t.state.name}) has no value"
    return t.value


def summarize(session: StudySession, space: SearchSpace, base: Params) -> dict[str, Any]:
    study = session.study
    trials = study.get_trials(deepcopy=False)
    counts = {state.name.lower(): sum(t.state == state for t in trials) for state in TrialState}
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = max(complete, key=_value) if complete else None
    baseline = next((t for t in trials if t.user_attrs.get(BASELINE_ATTR)), None)
    return {
        "study": study.study_name,
        "storage": session.spec.redacted(),
        "objective": f"best {OBJECTIVE} over a trial's epochs (class-disjoint validation split)",
        "epochs_per_trial": base.train.warmup_epochs + base.tune.epochs,
        "trials": {"total": len(trials), **{k: v for k, v in counts.items() if v}},
        "workers": sorted({t.user_attrs[WORKER_ATTR] for t in trials if WORKER_ATTR in t.user_attrs}),
        "best": None if best is None else _trial_summary(best, space, base),
        "current": None if baseline is None else {"trial": baseline.number, "state": baseline.state.name,
                                                  "value": baseline.value},
        "pruned": [_pruned_at(t) for t in trials if t.state == TrialState.PRUNED],
        "failed": {t.number: t.user_attrs.get(ERROR_ATTR, "worker lost or interrupted") for t in trials
                   if t.state == TrialState.FAIL},
        "importances": importances(study),
        "memory_verdict": memory_verdict(complete, base),
        **({"batch_verdict": batch_verdict(complete, base, space.dims[BATCH_KEY])} if BATCH_KEY in space.dims
           else {}),
    }


def _method(t: FrozenTrial, base: Params) -> str:
    return t.params.get("memory.method", base.memory.method)


def batch_verdict(complete: list[FrozenTrial], base: Params, batch: Dimension) -> str:
    """One sentence for a study that samples train.batch_size (tune.max_batch_size): does a memory at a smaller
    batch beat no memory at the largest batch in the space (the most a device without a memory can do)?"""
    largest = (max(c for c in batch.options if isinstance(c, (int, float))) if batch.type == "categorical"
               else batch.bounds[1])  # the batch sizes are numbers: the space's check loads each as params

    def size(t: FrozenTrial) -> int:
        return t.params.get(BATCH_KEY, base.train.batch_size)

    without = max((t for t in complete if _method(t, base) == "none" and size(t) == largest),
                  key=_value, default=None)
    smaller = max((t for t in complete if _method(t, base) != "none" and size(t) < largest),
                  key=_value, default=None)
    if without is None or smaller is None:
        missing = (f"without a memory at batch {largest:g}" if without is None
                   else f"with a memory at a batch below {largest:g}")
        return f"No complete trial {missing}: run more trials to compare a memory at a small batch with none."
    a, b = _value(smaller), _value(without)
    verdict = "beats" if a > b else "does not beat" if a < b else "ties"
    return (f"A memory at batch {size(smaller)} ({_method(smaller, base)}, #{smaller.number}: {OBJECTIVE} {a:.4f}) "
            f"{verdict} no memory at batch {largest:g} (#{without.number}: {b:.4f}; {a - b:+.4f}, one trial each, "
            "so a small difference may be noise).")


def memory_verdict(complete: list[FrozenTrial], base: Params) -> str:
    """One sentence: does a memory help on this data? The best complete trial with a memory against the best
    without one (`memory.method` is in the default space, with `none` among its choices)."""
    without = max((t for t in complete if _method(t, base) == "none"), key=_value, default=None)
    with_memory = max((t for t in complete if _method(t, base) != "none"), key=_value, default=None)
    if without is None or with_memory is None:
        missing = "without a memory (memory.method=none)" if without is None else "with a memory"
        return (f"No complete trial {missing} to compare with: put `none` and a memory method in "
                "tune.space's memory.method to ask whether a memory helps on this data.")
    a, b = _value(with_memory), _value(without)
    verdict = "helps" if a > b else "does not help" if a < b else "makes no difference"
    return (f"A memory {verdict} on this data: the best memory trial (#{with_memory.number}, "
            f"{_method(with_memory, base)}) reached validation {OBJECTIVE} {a:.4f}, the best trial without one "
            f"(#{without.number}) {b:.4f} ({a - b:+.4f}; one trial each, so a small difference may be noise).")


def _trial_summary(trial: FrozenTrial, space: SearchSpace, base: Params) -> dict[str, Any]:
    return {"trial": trial.number, "value": trial.value, "epoch": trial.user_attrs.get("best_epoch"),
            "params": trial.params, "overrides": space.to_params(trial.params, base)}


def _pruned_at(trial: FrozenTrial) -> dict[str, Any]:
    step = trial.last_step
    return {"trial": trial.number, "epoch": step,
            "value": None if step is None else trial.intermediate_values.get(step)}


def importances(study: optuna.Study) -> dict[str, float]:
    """fANOVA importances of the parameters for the objective over complete trials ({} with too few)."""
    values = [_value(t) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if len(values) < 2 or max(values) - min(values) < 1e-12:  # nothing to explain yet
        return {}
    try:
        evaluator = optuna.importance.FanovaImportanceEvaluator(seed=0)
        return {k: round(float(v), 4) for k, v in
                optuna.importance.get_param_importances(study, evaluator=evaluator).items()}
    except (ValueError, RuntimeError) as exc:  # e.g. every complete trial sampled the same values
        log.warning("no parameter importances: %s", exc)
        return {}


def write_plots(study: optuna.Study, out_dir: str | Path, space: SearchSpace) -> list[Path]:
    """Optimization history, parameter importances, and memory.kalman.r (or r/q) vs memory.size; a plot that
    the study cannot draw yet (too few complete trials, a parameter not in the space) is skipped."""
    from matplotlib import pyplot as plt
    from matplotlib.figure import Figure
    from optuna.visualization import matplotlib as vis

    out_dir = Path(out_dir)
    complete = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    r = LAMBDA if space.lambda_mode else "memory.kalman.r"
    # A drawing is one Axes, or a grid of them (param_importances with several objectives).
    plots: dict[str, Callable[[], Axes | np.ndarray]] = {
        "optimization_history": lambda: vis.plot_optimization_history(study)}
    if importances(study) and len(space.dims) > 1:
        plots["param_importances"] = lambda: vis.plot_param_importances(
            study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0))
    if complete >= 2 and {r, "memory.size"} <= space.dims.keys():
        plots["contour_r_memory_size"] = lambda: vis.plot_contour(study, params=[r, "memory.size"])
    for stale in ("optimization_history", "param_importances", "contour_r_memory_size"):
        (out_dir / f"{stale}.png").unlink(missing_ok=True)  # a plot this study cannot draw must not linger
    written = []
    for name, draw in plots.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            try:
                axes = draw()
            except (ValueError, RuntimeError) as exc:
                log.warning("plot %s skipped: %s", name, exc)
                continue
        figure = axes.flat[0].figure if isinstance(axes, np.ndarray) else axes.figure
        assert isinstance(figure, Figure)  # optuna draws on a figure of its own, not a subfigure
        figure.set_size_inches(8, 5)
        figure.tight_layout()
        path = out_dir / f"{name}.png"
        with atomic_path(path) as tmp:
            figure.savefig(tmp, format="png", dpi=100)
        plt.close(figure)
        written.append(path)
    return written


def tuned_values(summary: Mapping[str, Any]) -> dict[str, Any]:
    return dict(summary["best"]["overrides"]) if summary.get("best") else {}


def write_tuned(path: str | Path, summary: Mapping[str, Any]) -> dict[str, Any]:
    """params.tuned.yaml: the best trial's values as a params.yaml fragment (same sections), written
    atomically."""
    values = tuned_values(summary)
    nested: dict[str, Any] = {}
    for key, value in values.items():
        *sections, leaf = key.split(".")
        node = nested
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    best, current = summary["best"], summary.get("current") or {}
    baseline = "" if current.get("value") is None else f"; current params {current['value']:.4f}"
    header = (f"# xbn tune: best of study {summary['study']}: trial {best['trial']}, {OBJECTIVE} "
              f"{best['value']:.4f} at epoch {best['epoch']}{baseline}.\n"
              "# Merge into params.yaml (`xbn tune --apply`, or the tune flow with apply=True); retrain.\n")
    write_text(path, header + yaml.safe_dump(nested, sort_keys=False))
    return values


def set_yaml_values(text: str, values: Mapping[str, Any]) -> str:
    """Set dotted keys in block-style YAML text line by line, keeping comments and layout. The result is
    checked by parsing it; a key the text does not hold raises (add it by hand)."""
    lines = text.splitlines(keepends=True)
    pattern = re.compile(r"^(?P<indent> *)(?P<key>[^\s#:][^:#]*?):(?P<gap>[ \t]*)(?P<value>[^#\n]*?)"
                         r"(?P<comment>[ \t]+#.*)?$")
    path: list[tuple[int, str]] = []
    found = set()
    for i, line in enumerate(lines):
        match = pattern.match(line.rstrip("\r\n"))
        if not match:
            continue
        indent = len(match["indent"])
        while path and path[-1][0] >= indent:
            path.pop()
        key = ".".join([p for _, p in path] + [match["key"].strip()])
        if not match["value"]:  # a section header
            path.append((indent, match["key"].strip()))
            continue
        if key in values:
            head = f"{match['indent']}{match['key']}:{match['gap'] or ' '}{yaml_scalar(values[key])}"
            if comment := match["comment"]:  # keep the comment in its column where the new value allows
                column = match.start("comment") + len(comment) - len(comment.lstrip())
                head += " " * max(1, column - len(head)) + comment.lstrip()
            lines[i] = head + line[len(line.rstrip("\r\n")):]
            found.add(key)
    if missing := [k for k in values if k not in found]:
        raise KeyError(f"not in the params file as block-style keys: {', '.join(missing)} (add them by hand)")
    result = "".join(lines)
    expected = yaml.safe_load(text) or {}
    for key, value in values.items():
        *sections, leaf = key.split(".")
        node = expected
        for section in sections:
            node = node[section]
        node[leaf] = value
    if yaml.safe_load(result) != expected:
        raise ValueError("merging the tuned values changed more than the tuned keys; merge them by hand")
    return result


def apply_tuned(params_file: str | Path, values: Mapping[str, Any]) -> None:
    """Write the tuned values into a params file (atomically), keeping its comments."""
    path = Path(params_file)
    write_text(path, set_yaml_values(path.read_text(), values))
    log.info("merged %s into %s", ", ".join(values), path)
