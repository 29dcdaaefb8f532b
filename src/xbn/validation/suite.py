"""The great-expectations suite over a manifest and its images.

`validate_manifest` adds the computed per-row columns (`xbn.validation.columns`) to the manifest, builds one
GX 1.x suite for what the frame holds, runs it on an ephemeral pandas data source with
`result_format="COMPLETE"` (so GX lists the index of every unexpected row) and turns GX's results into a
`ValidationResult` that names each failing expectation and example rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from xbn.config import ValidateConfig
from xbn.data.errors import DatasetError
from xbn.data.manifest import COLUMNS, SPLITS, read_manifest
from xbn.validation.columns import EVAL_SIDE, class_columns, duplicate_columns, image_columns
from xbn.validation.result import MAX_EXAMPLES, ExpectationOutcome, ValidationResult

# Published metric-learning split sizes as (images, classes); None where not published for that group.
# "train" counts train+val rows, because `prepare` carves val out of the published train classes;
# "query+gallery" is the In-Shop test side, whose items are shared by its two splits.
PUBLISHED_COUNTS: dict[str, dict[str, tuple[int | None, int | None]]] = {
    "cub": {"train": (5_864, 100), "test": (5_924, 100)},
    "cars196": {"train": (8_054, 98), "test": (8_131, 98)},
    "sop": {"train": (59_551, 11_318), "test": (60_502, 11_316)},
    "inshop": {"train": (25_882, 3_997), "query": (14_218, None), "gallery": (12_612, None),
               "query+gallery": (None, 3_985)},
}


@dataclass(frozen=True)
class _Check:
    """One expectation with our stable name; `detail` is the table column shown beside each failing row."""

    name: str
    description: str
    expectation: Any  # a great_expectations Expectation (GX is imported lazily: ~4 s)
    detail: str | None = None
    expected: Any = None


def _gx() -> Any:
    # Analytics would try the network on every run; respect an explicit opt-in from the environment.
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx

    return gx


def _split_group(name: str) -> list[str]:
    return ["train", "val"] if name == "train" else name.split("+")


def _checks(table: pd.DataFrame, cfg: ValidateConfig, dataset: str) -> list[_Check]:
    """The expectations that apply to `table`: column checks for the columns it has, and the row checks
    whose inputs could be computed (a manifest without `path` gets no file checks, and so on)."""
    gx = _gx()
    from great_expectations.expectations.row_conditions import Column

    E = gx.expectations
    checks: list[_Check] = []

    def add(name: str, description: str, expectation: Any, detail: str | None = None,
            expected: Any = None) -> None:
        expectation.meta = {"xbn_check": name}  # how a GX result is mapped back to its check
        checks.append(_Check(name, description, expectation, detail, expected))

    for col in COLUMNS:
        add(f"{col}_column_exists", f"the manifest has a `{col}` column", E.ExpectColumnToExist(column=col))
    for col in (c for c in COLUMNS if c in table):
        add(f"{col}_not_null", f"no `{col}` is missing", E.ExpectColumnValuesToNotBeNull(column=col))
        add(f"{col}_is_text", f"every `{col}` is text",
            E.ExpectColumnValuesToBeOfType(column=col, type_="str"), detail=col, expected="str")
    if "label" in table:
        add("label_not_blank", "no label is blank",
            E.ExpectColumnValuesToMatchRegex(column="label", regex=r"\S"))
    if "split" in table:
        add("split_known", f"every split is one of {list(SPLITS)}",
            E.ExpectColumnValuesToBeInSet(column="split", value_set=list(SPLITS)), detail="split")
    if "resolved" in table:
        add("path_inside_root", "every path resolves inside the dataset root",
            E.ExpectColumnValuesToBeInSet(column="inside_root", value_set=[True]), detail="resolved")
        add("file_exists", "every listed file exists",
            E.ExpectColumnValuesToBeInSet(column="exists", value_set=[True]), detail="resolved")
        add("image_decodes", "every file decodes as an image (verified and fully loaded)",
            E.ExpectColumnValuesToBeInSet(column="decodes", value_set=[True]), detail="decode_error")
        for side in ("width", "height"):
            add(f"image_{side}_in_bounds",
                f"every image {side} is within [{cfg.min_image_side}, {cfg.max_image_side}] px",
                E.ExpectColumnValuesToBeBetween(column=side, min_value=cfg.min_image_side,
                                                max_value=cfg.max_image_side), detail=side)
    if "class_images" in table:
        add("class_min_images",
            f"every class of every split has at least {cfg.min_images_per_class} images "
            f"(validate.min_images_per_class)",
            E.ExpectColumnValuesToBeBetween(column="class_images", min_value=cfg.min_images_per_class),
            detail="class_images")
        add("classes_disjoint_train_eval", "no class is in both train/val and test/query/gallery",
            E.ExpectColumnValuesToBeInSet(column="label_in_train_and_eval", value_set=[False]),
            detail="label_splits")
        add("classes_disjoint_train_val", "no class is in both train and val",
            E.ExpectColumnValuesToBeInSet(column="label_in_train_and_val", value_set=[False]),
            detail="label_splits")
        add("train_split_not_empty", "the train split has images",
            E.ExpectTableRowCountToBeBetween(min_value=1, row_condition=Column("split") == "train"),
            expected=">= 1")
        add("eval_splits_not_empty", "the test/query/gallery splits have images",
            E.ExpectTableRowCountToBeBetween(min_value=1,
                                             row_condition=Column("split").is_in(list(EVAL_SIDE))),
            expected=">= 1")
    if "image_in_other_split" in table:
        add("no_image_in_two_splits", "no image file (by content hash) is in two splits",
            E.ExpectColumnValuesToBeInSet(column="image_in_other_split", value_set=[False]),
            detail="duplicate_of")
    if cfg.check_published_counts and dataset in PUBLISHED_COUNTS and {"label", "split"} <= set(table):
        for group, (images, classes) in PUBLISHED_COUNTS[dataset].items():
            where = Column("split").is_in(_split_group(group))
            members = " + ".join(_split_group(group))
            if images is not None:
                add(f"published_images_{group}", f"{members} has the published {images} images of {dataset}",
                    E.ExpectTableRowCountToEqual(value=images, row_condition=where), expected=images)
            if classes is not None:
                add(f"published_classes_{group}",
                    f"{members} has the published {classes} classes of {dataset}",
                    E.ExpectColumnUniqueValueCountToBeBetween(column="label", min_value=classes,
                                                              max_value=classes, row_condition=where),
                    expected=classes)
    return checks


def _computed(frame: pd.DataFrame, root: str | Path) -> pd.DataFrame:
    """The manifest plus every per-row column its present columns allow."""
    parts = [frame]
    if "path" in frame:
        parts.append(image_columns(frame["path"], root))
    if {"label", "split"} <= set(frame):
        parts.append(class_columns(frame))
    table = pd.concat(parts, axis=1)
    if {"sha256", "split"} <= set(table):
        table = pd.concat([table, duplicate_columns(table)], axis=1)
    return table


def _run_suite(table: pd.DataFrame, checks: list[_Check]) -> dict[str, Any]:
    """Run `checks` on `table` in a throwaway GX context; GX results by check name."""
    gx = _gx()
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)  # no tqdm bars in stage logs
    batch = (context.data_sources.add_pandas("manifest").add_dataframe_asset("manifest")
             .add_batch_definition_whole_dataframe("all rows"))
    suite = context.suites.add(gx.ExpectationSuite(name="manifest",
                                                   expectations=[c.expectation for c in checks]))
    definition = context.validation_definitions.add(gx.ValidationDefinition(name="manifest", data=batch,
                                                                            suite=suite))
    run = definition.run(batch_parameters={"dataframe": table}, result_format="COMPLETE")
    return {r.expectation_config.meta["xbn_check"]: r for r in run.results}


def _plain(value: Any) -> Any:
    """A JSON-ready scalar: missing values become None, numpy scalars Python ones."""
    if value is None or (not isinstance(value, (list, tuple, dict)) and pd.isna(value)):
        return None
    return value.item() if hasattr(value, "item") else value


def _exception_message(info: Any) -> str | None:
    # GX reports an error either flat ({"raised_exception": ...}) or per metric ({metric_id: {...}}).
    if not isinstance(info, dict):
        return None
    if "raised_exception" in info:
        return info.get("exception_message") if info["raised_exception"] else None
    messages = [m for m in (_exception_message(v) for v in info.values()) if m]
    return "; ".join(messages) or None


def _outcome(check: _Check, gx_result: Any, table: pd.DataFrame) -> ExpectationOutcome:
    result = gx_result.result or {}
    rows = result.get("unexpected_index_list") or []
    examples = []
    for row in rows[:MAX_EXAMPLES]:
        example = {"row": int(row), **{c: _plain(table.at[row, c]) if c in table else None for c in COLUMNS}}
        if check.detail is not None:
            example["detail"] = _plain(table.at[row, check.detail])
        examples.append(example)
    observed = result.get("observed_value")
    return ExpectationOutcome(
        name=check.name, description=check.description, expectation=gx_result.expectation_config.type,
        success=bool(gx_result.success), column=gx_result.expectation_config.kwargs.get("column"),
        unexpected_count=int(result.get("unexpected_count") or 0), examples=examples,
        observed=_plain(observed) if observed is not None and check.expected is not None else None,
        expected=check.expected, message=_exception_message(gx_result.exception_info),
    )


def _summary(frame: pd.DataFrame) -> dict[str, Any]:
    summary: dict[str, Any] = {"rows": len(frame)}
    if {"label", "split"} <= set(frame):
        summary["splits"] = {
            str(split): {"images": len(part), "classes": int(part["label"].nunique())}
            for split, part in frame.groupby("split", sort=False)
        }
    if {"width", "height", "mode"} <= set(frame):
        summary["profile"] = image_profile(frame)
    return summary


def image_profile(table: pd.DataFrame) -> dict[str, Any]:
    """The decoded images' size and mode distributions: what the drift report compares week to week."""
    quantiles = (0.05, 0.5, 0.95)
    profile: dict[str, Any] = {}
    for side in ("width", "height"):
        values = table[side].dropna().astype(float)
        profile[side] = {f"p{round(q * 100)}": float(values.quantile(q)) if len(values) else None
                         for q in quantiles}
    modes = table["mode"].dropna().value_counts()
    profile["mode"] = {str(k): round(float(v) / max(int(modes.sum()), 1), 4) for k, v in modes.items()}
    return profile


def validate_manifest(
    frame: pd.DataFrame, root: str | Path, cfg: ValidateConfig, dataset: str
) -> ValidationResult:
    """Check a manifest (`path,label,split[,x1,y1,x2,y2]`, paths relative to `root`) and its images.

    Rows are renumbered 0..n-1 (the order of the manifest file). Published split sizes are checked only for
    the datasets in `PUBLISHED_COUNTS` and when `cfg.check_published_counts`.
    """
    frame = frame.reset_index(drop=True)
    table = _computed(frame, root)
    checks = _checks(table, cfg, dataset)
    results = _run_suite(table, checks)
    outcomes = [_outcome(c, results[c.name], table) for c in checks]
    return ValidationResult(dataset=dataset, root=str(root), outcomes=outcomes, summary=_summary(table))


def validate_manifest_file(
    path: str | Path, root: str | Path, cfg: ValidateConfig, dataset: str
) -> ValidationResult:
    """`validate_manifest` on the manifest CSV at `path`.

    A file the reader refuses (missing, wrong header or columns, an unknown split, an empty label, a path
    with `..`) becomes one failed expectation, `manifest_readable`, carrying the reader's message, so that
    it is reported like any other failure.
    """
    try:
        frame = read_manifest(path)
    except DatasetError as exc:
        return ValidationResult.from_error("manifest_readable", f"the manifest {path} can be read",
                                           exc, dataset=dataset, root=str(root))
    return validate_manifest(frame, root, cfg, dataset)
