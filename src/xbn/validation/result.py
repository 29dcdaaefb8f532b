"""The outcome of a validation run: one entry per expectation, the rows that broke it, and two renderings
(JSON for machines and DVC, Markdown for the person who has to fix the data).

Kept free of great-expectations so that the CLI can import `ValidationFailed` without paying GX's import.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from xbn.data.errors import DatasetError

MAX_EXAMPLES = 10


@dataclass(frozen=True)
class ExpectationOutcome:
    """One expectation's verdict.

    `name` is our stable id (e.g. `file_exists`), `expectation` the GX expectation type, `column` the column
    it looked at (None for table-level checks). `examples` holds up to `MAX_EXAMPLES` failing rows as
    `{row, path, label, split}` plus `detail` where the check has one (the decode error, the duplicate...).
    `observed`/`expected` are set for table-level checks (row counts); `message` explains errors.
    """

    name: str
    description: str
    expectation: str
    success: bool
    column: str | None = None
    unexpected_count: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    observed: Any = None
    expected: Any = None
    message: str | None = None


@dataclass(frozen=True)
class ValidationResult:
    """All outcomes of one run over a manifest; `success` only if every expectation held."""

    dataset: str
    root: str
    outcomes: list[ExpectationOutcome]
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        return all(o.success for o in self.outcomes)

    @property
    def failed(self) -> list[ExpectationOutcome]:
        return [o for o in self.outcomes if not o.success]

    def outcome(self, name: str) -> ExpectationOutcome:
        """The outcome named `name` (KeyError if that expectation was not evaluated)."""
        for o in self.outcomes:
            if o.name == name:
                return o
        raise KeyError(f"no expectation {name!r}; evaluated: {[o.name for o in self.outcomes]}")

    @classmethod
    def from_error(
        cls, name: str, description: str, error: Exception, dataset: str, root: str
    ) -> ValidationResult:
        """A run that could not get as far as the suite (an unreadable manifest): one failed expectation
        carrying the reader's message, so it is reported the same way as any other failure."""
        outcome = ExpectationOutcome(name=name, description=description, expectation="xbn.data.read_manifest",
                                     success=False, message=str(error))
        return cls(dataset=dataset, root=root, outcomes=[outcome], summary={"rows": 0})

    def failure_message(self, report: str | None = None) -> str:
        """One line naming each failing expectation and how many rows broke it (for the exception/CLI)."""
        parts = [f"{o.name} ({_rows(o.unexpected_count)}{_first(o)})" if o.unexpected_count else o.name
                 for o in self.failed]
        where = f"; see {report}" if report else ""
        return f"data validation failed: {', '.join(parts)}{where}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "success": self.success,
            "dataset": self.dataset,
            "root": self.root,
            "summary": {**self.summary, "evaluated": len(self.outcomes),
                        "failed": [o.name for o in self.failed]},
            "expectations": [asdict(o) for o in self.outcomes],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)

    def to_markdown(self) -> str:
        status = "PASSED" if self.success else "FAILED"
        rows = self.summary.get("rows", 0)
        lines = [f"# Data validation: {status}", "",
                 f"Dataset `{self.dataset}`, root `{self.root}`, {rows} manifest rows."]
        splits = self.summary.get("splits") or {}
        if splits:
            lines.append("Splits: " + ", ".join(f"{s} {v['images']} images / {v['classes']} classes"
                                                for s, v in splits.items()) + ".")
        lines += ["", f"{len(self.failed)} of {len(self.outcomes)} expectations failed."]
        if self.failed:
            lines.append("Rows are numbered from 0 after the header (CSV line = row + 2).")
        for o in self.failed:
            lines += ["", f"## FAILED `{o.name}`: {o.description}", "", _what(o)]
            if o.message:
                lines += ["", f"> {_one_line(o.message)}"]
            if o.examples:
                shown = f"first {len(o.examples)} of {o.unexpected_count}" if o.unexpected_count > len(
                    o.examples) else f"all {len(o.examples)}"
                lines += ["", f"Unexpected rows ({shown}):", "", "| row | path | label | split | detail |",
                          "|---:|---|---|---|---|"]
                lines += [f"| {e['row']} | {_cell(e['path'])} | {_cell(e['label'])} | {_cell(e['split'])} "
                          f"| {_cell(e.get('detail'))} |" for e in o.examples]
        passed = [o for o in self.outcomes if o.success]
        if passed:
            lines += ["", "## Passed", ""] + [f"- `{o.name}`: {o.description}" for o in passed]
        return "\n".join(lines) + "\n"


class ValidationFailed(DatasetError):
    """The dataset broke at least one expectation; `result` holds every outcome (the reports are written).

    The message is the only positional argument so that the exception survives pickling (process pools,
    Prefect); `result` is then lost, the message is not.
    """

    def __init__(self, message: str, result: ValidationResult | None = None) -> None:
        super().__init__(message)
        self.result = result


def _what(o: ExpectationOutcome) -> str:
    on = f" on column `{o.column}`" if o.column else ""
    text = f"`{o.expectation}`{on}"
    if o.unexpected_count:
        text += f": {_rows(o.unexpected_count)} unexpected"
    if o.expected is not None or o.observed is not None:
        text += f": observed {o.observed}, expected {o.expected}"
    return text + "."


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _one_line(value: Any) -> str:
    return " ".join(str(value).split())


def _cell(value: Any) -> str:
    # Paths may contain pipes or backticks; keep the table intact.
    return "" if value is None else _one_line(value).replace("|", "\\|")


def _first(outcome: ExpectationOutcome, n: int = 3) -> str:
    """The first failing rows as the console shows them: `: row 4 images/a/x.txt (cannot identify image)`."""
    shown = []
    for e in outcome.examples[:n]:
        what = e.get("path") or e.get("label")
        detail = e.get("detail")
        shown.append(f"row {e['row']} {what}" + (f" ({str(detail)[:80]})" if detail not in (None, "", what) else ""))
    more = ", ..." if outcome.unexpected_count > len(shown) else ""
    return f": {', '.join(shown)}{more}" if shown else ""
