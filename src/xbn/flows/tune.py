"""The tuning flow: an Optuna study over `tune.space` (the `tune` stage), then, if asked, the best values
merged into the params file for the next retraining.

The study task calls `xbn.stages.tune.tune`, the function behind `xbn tune`. A retried task continues the same
study (it is persistent, and keyed by the params): only the trials still missing from `tune.trials` run.

    python -m xbn.flows.tune                       # one worker process
    python -m xbn.flows.tune --workers 4 --apply   # four on this machine, then merge into params.yaml
"""

from __future__ import annotations

import argparse

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from xbn.config import Params
from xbn.flows.tasks import TASK_OPTIONS
from xbn.stages.names import load_checked
from xbn.utils.allocator import fix_malloc_thresholds
from xbn.utils.secrets import masks_exceptions


@task(**TASK_OPTIONS)
@masks_exceptions
def run_study(params: Params, workers: int) -> dict:
    from xbn.stages.tune import tune

    return tune(params, workers=workers)


@task(**TASK_OPTIONS | {"retries": 0})
@masks_exceptions
def merge_best(params_path: str, summary: dict) -> dict:
    from xbn.tuning import apply_tuned, tuned_values

    values = tuned_values(summary)
    apply_tuned(params_path, values)
    return values


def summary_markdown(summary: dict) -> str:
    best, current, trials = summary["best"], summary.get("current") or {}, summary["trials"]
    rows = ["| key | tuned value |", "|---|---|"] + [f"| `{k}` | {v:.6g} |" if isinstance(v, float) else
                                                   f"| `{k}` | {v} |" for k, v in best["overrides"].items()]
    importance = ["| parameter | importance |", "|---|---|"] + [
        f"| `{k}` | {v:.3f} |" for k, v in summary.get("importances", {}).items()]
    baseline = "" if current.get("value") is None else f" (current params: {current['value']:.4f})"
    return "\n".join([
        f"# Tuning study `{summary['study']}`",
        (f"**Best:** trial {best['trial']}, validation R@1 {best['value']:.4f} at epoch {best['epoch']}"
         f"{baseline}"),
        (f"**Trials:** {trials.get('complete', 0)} complete, {trials.get('pruned', 0)} pruned, "
         f"{trials.get('fail', 0)} failed of {trials['total']}"),
        "", *rows, "",
        *(importance if summary.get("importances") else ["(no parameter importances yet)"]), "",
        f"Written to `{summary.get('output')}`" + (f", merged into `{summary['applied_to']}`"
                                                  if summary.get("applied_to") else ""),
    ])


@flow(name="xbn-tune", log_prints=True)
@masks_exceptions
def tune_flow(params_path: str = "params.yaml", overrides: list[str] | None = None, workers: int = 1,
              apply: bool = False) -> dict:
    fix_malloc_thresholds()  # as `xbn` does: a Prefect worker runs this flow in a process of its own
    params = load_checked(params_path, overrides)
    summary = run_study(params, workers)
    if apply:
        merge_best(params_path, summary)
        summary["applied_to"] = params_path
    create_markdown_artifact(markdown=summary_markdown(summary), key="xbn-tune-summary",
                             description="best trial, trial counts and parameter importances")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--apply", action="store_true", help="merge the best values into --params")
    args = parser.parse_args(argv)
    tune_flow(args.params, args.overrides, args.workers, args.apply)


if __name__ == "__main__":
    main()
