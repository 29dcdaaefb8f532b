"""The one screen docs/benchmarks.md opens with (issue 44 item 4): one row per target, the latest verdict on each
kind of machine (an AVX2 CPU, an AVX512 CPU, a GPU) and a link to its section. Each target's per-configuration
rows (every M and B of the memory benchmark, ...) stay in the section that measured them.

A target is what `report.py`'s sections return (`section`, `file`, `verdict`, and either `what` or the memory
benchmark's `ratio`, `memory_size`, `batch`, `workload`); `annotate` adds where it ran and where its section is.
Smoke runs (`*_quick` files) are left out of the screen: their numbers check the machinery only.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from benchmarks.common import markdown_table

KINDS = ("AVX2 CPU", "AVX512 CPU", "GPU")


def machine_kind(data: dict[str, Any]) -> str:
    """Where a results file was measured: a GPU if its file, its machine or its runs name one, else the CPU's
    SIMD level (AVX512 or not) from its provenance."""
    if ("cuda" in data.get("_file", "") or data.get("gpu") or data.get("machine", {}).get("gpu")
            or any(isinstance(r, dict) and r.get("gpu") for r in data.get("runs", []))):
        return "GPU"
    machine = (data.get("provenance") or {}).get("machine") or data.get("machine", {})
    flags = machine.get("cpu_flags") or []
    return "AVX512 CPU" if machine.get("avx512") or any(f.startswith("avx512") for f in flags) else "AVX2 CPU"


def anchor(text: str) -> str:
    """The docs site's anchor of a section's first heading (Python-Markdown's toc: runs of spaces and hyphens
    become one hyphen; GitHub's is the same unless a heading's punctuation stood between two spaces)."""
    heading = next((line for line in text.splitlines() if line.startswith("## ")), "").removeprefix("## ")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^a-z0-9 _-]", "", heading.lower()).strip())


def annotate(found: list[dict[str, Any]], data: dict[str, Any], text: str) -> list[dict[str, Any]]:
    when = (data.get("provenance") or {}).get("finished_utc") or data.get("finished") or ""
    return [t | {"kind": machine_kind(data), "anchor": anchor(text), "when": when} for t in found]


def label(target: dict[str, Any]) -> str:
    """The target itself, without its configuration (the memory benchmark's M and B)."""
    bound = (f", at least {target['at_least']}" if "at_least" in target
             else f", at most {target['at_most']}" if "at_most" in target else "")
    loss = ", all pairs" if "all_pairs" in target.get("file", "") else ""  # memory_*_all_pairs: loss.miner=null
    what = target.get("what") or f"{target['ratio']} ({target['workload']}{loss})"
    return what + bound


def _word(verdict: Any) -> str:
    if verdict is None:
        return "not measurable"
    return ("met" if verdict else "missed") if isinstance(verdict, bool) else str(verdict)


def _measured(target: dict[str, Any]) -> str:
    if "low" in target:  # the median's interval (memory targets since issue 44)
        return f"{target['median']} [{target['low']}, {target['high']}]"
    if "median" in target:
        return f"{target['median']} [{target['p25']}, {target['p75']}]"
    value = target.get("value", "-")
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _cell(targets: list[dict[str, Any]]) -> str:
    if not targets:
        return "not measured on this kind of machine"
    latest = max(t["when"] for t in targets)
    targets = [t for t in targets if t["when"] == latest]  # the newest file of this kind of machine
    if len(targets) == 1:
        return f"**{_word(targets[0]['verdict'])}**: {_measured(targets[0])}"
    counts = defaultdict(int)
    for t in targets:
        counts[_word(t["verdict"])] += 1
    return ", ".join(f"**{n} {v}**" for v, n in sorted(counts.items())) + f" of {len(targets)} configurations"


# Targets kept in their sections but off the screen (at most 30 live rows): each pattern (matched against the row's
# label) with why it is not a live target any more.
RETIRED = (
    (r"\(clustered, all pairs\)", "the memory's cost without the miner: the shipped loss mines (its rows stand)"),
    (r"^(axbn_auto|ema)/", "estimators xbn does not ship"),
    (r"^largest absolute metric difference", "the metrics' exactness: a property, not a target to move"),
    (r"^AccuracyCalculator time / ours-fp32", "the float32 path, behind the shipped one"),
    (r"^training epoch wall time, decode cache", "replaced by make run's training wall time (section 11): the step "
                                                 "that counts is the whole epoch"),
    (r"^ONNX Runtime / torch", "replaced by xbn serve against ONNX Runtime: serving runs ONNX Runtime itself"),
    (r"(one at a time <= 50|vs exact >= 0\.9|peak resident memory \(GB\) <= 4), 1000000 rows",
     "the 10,000,000-row index's targets stand; the 1,000,000-row run shows their shape"),
    (r"^second DVC snapshot of 10000 ", "the 100,000-file row is the target at scale"),
    (r"share of drift checks where XBN's mapped rows", "Fig. 2's ordering, a property of the map: section 14 "
                                                       "keeps it"),
)


def retired(name: str) -> str | None:
    return next((why for pattern, why in RETIRED if re.search(pattern, name)), None)


def summary_table(targets: list[dict[str, Any]]) -> str:
    """The screen: a row per live target (in the order the sections give them), a column per kind of machine;
    then the retired ones, each with why."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for t in targets:
        if "_quick" not in t["file"]:
            groups.setdefault(label(t), []).append(t)
    rows, off = [], {}
    for name, group in groups.items():
        links = sorted({f"[{t['section']}](#{t['anchor']})" for t in group})
        if why := retired(name):
            off.setdefault(why, []).append(f"{name} ({', '.join(links)})")
            continue
        rows.append([name, *(_cell([t for t in group if t["kind"] == kind]) for kind in KINDS), ", ".join(links)])
    lines = [markdown_table(["target", *KINDS, "section"], rows), "", f"{len(rows)} live targets."
             + (" Off this table, still judged in their sections:" if off else "")]
    return "\n".join(lines + ([""] if off else []) + [f"- {why}: {'; '.join(names)}." for why, names in off.items()])


def section_targets(found: list[dict[str, Any]]) -> str:
    """A section's own targets, every configuration: appended to the section that measured them."""
    rows = [[label(t) + (f" (M = {t['memory_size']}, B = {t['batch']})" if "memory_size" in t else ""),
             _measured(t), f"**{_word(t['verdict'])}**"] for t in found]
    return "\n".join(["", "Targets of this section:", "", markdown_table(["target", "measured", "verdict"], rows),
                      ""])
