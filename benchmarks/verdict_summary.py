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
    """GitHub's anchor of a section's first heading."""
    heading = next((line for line in text.splitlines() if line.startswith("## ")), "").removeprefix("## ")
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


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
        return "-"
    latest = max(t["when"] for t in targets)
    targets = [t for t in targets if t["when"] == latest]  # the newest file of this kind of machine
    if len(targets) == 1:
        return f"**{_word(targets[0]['verdict'])}**: {_measured(targets[0])}"
    counts = defaultdict(int)
    for t in targets:
        counts[_word(t["verdict"])] += 1
    return ", ".join(f"**{n} {v}**" for v, n in sorted(counts.items())) + f" of {len(targets)} configurations"


def summary_table(targets: list[dict[str, Any]]) -> str:
    """The screen: a row per target (in the order the sections give them), a column per kind of machine."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for t in targets:
        if "_quick" not in t["file"]:
            groups.setdefault(label(t), []).append(t)
    rows = []
    for name, group in groups.items():
        links = sorted({f"[{t['section']}](#{t['anchor']})" for t in group})
        rows.append([name, *(_cell([t for t in group if t["kind"] == kind]) for kind in KINDS), ", ".join(links)])
    return markdown_table(["target", *KINDS, "section"], rows)


def section_targets(found: list[dict[str, Any]]) -> str:
    """A section's own targets, every configuration: appended to the section that measured them."""
    rows = [[label(t) + (f" (M = {t['memory_size']}, B = {t['batch']})" if "memory_size" in t else ""),
             _measured(t), f"**{_word(t['verdict'])}**"] for t in found]
    return "\n".join(["", "Targets of this section:", "", markdown_table(["target", "measured", "verdict"], rows),
                      ""])
