"""`make run`'s training wall time, an older commit against this one, on the same machine in one sitting (issue 28:
new / old <= 0.6).

    python -m benchmarks train_time [--old COMMIT] [--rounds 1] [--set key=value ...] [--quick]

Each commit is checked out (detached, `git worktree`) into a temporary folder and its own `xbn train` runs there,
from its own params.yaml, on the glyph default that its `xbn generate` and `xbn prepare` wrote (untimed). Only the
`train` stage is timed: the stage `make run` spends its time in. Both run in the one virtualenv (the code comes
from each checkout's `src/` on PYTHONPATH) with `tracking.enabled=false`, so an MLflow store's start-up does not
count for either; `--set` overrides apply to both. The rounds alternate which commit goes first, and the result
is the ratio of the medians (new / old) with each round's own ratio, so that load on the machine hits both.
Writes benchmarks/results/train_time.json (train_time_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import provenance
from benchmarks.common import write_result

# The parent of 5a89001, the commit that made `train.channels_last: auto` decide on the CPU too.
OLD_DEFAULT = "e2ec823"
TARGET = 0.6
QUICK = ["data.glyphs.classes=48", "data.glyphs.images_per_class=8", "train.epochs=1", "train.warmup_epochs=1",
         "eval.baseline=false", "eval.embedding_space=false"]
XBN = "from xbn.cli import main; raise SystemExit(main())"
# From each run's metrics/train.json: the accuracy it reached (same seed: the speed-up must not cost it) and the
# memory format and what chose it.
RECORDED = ("best_val_recall@1", "best_epoch", "train_seconds", "channels_last", "chosen_by")


def checkout(commit: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(provenance.REPO), "worktree", "add", "--detach", "-f", str(where), commit],
                   check=True, capture_output=True, text=True)
    return where


def xbn(code: Path, workdir: Path, *args: str) -> float:
    """Run `xbn args` with the checkout `code`'s package in `workdir`; wall seconds. Raises with its stderr."""
    env = {**os.environ, "PYTHONPATH": f"{code / 'src'}{os.pathsep}{code}"}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", XBN, *args], cwd=workdir, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode:
        raise RuntimeError(f"xbn {' '.join(args)} in {workdir} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return seconds


def prepared(code: Path, workdir: Path, overrides: list[str]) -> list[str]:
    """The checkout's params.yaml in `workdir`, its glyph set generated and prepared; the `--set` arguments."""
    workdir.mkdir(parents=True)
    (workdir / "params.yaml").write_text((code / "params.yaml").read_text())
    sets = [a for o in ["tracking.enabled=false", *overrides] for a in ("--set", o)]
    for stage in ("generate", "prepare"):
        xbn(code, workdir, stage, "-q", *sets)
    return sets


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks train_time")
    parser.add_argument("--old", default=OLD_DEFAULT, help="the commit to compare against (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    overrides = [*QUICK, *args.overrides] if args.quick else args.overrides
    new = provenance.git(provenance.REPO, "rev-parse", "HEAD").strip()
    old = provenance.git(provenance.REPO, "rev-parse", args.old).strip()
    times: dict[str, list[float]] = {"old": [], "new": []}
    loads: list[float] = []
    runs: dict[str, list[dict]] = {"old": [], "new": []}  # what each run's metrics/train.json says
    with tempfile.TemporaryDirectory(prefix="xbn_train_time_") as tmp:
        root = Path(tmp)
        codes = {"old": checkout(old, root / "old"), "new": checkout(new, root / "new")}
        try:
            for r in range(args.rounds):
                for which in (("new", "old") if r % 2 else ("old", "new")):
                    workdir = root / f"run-{which}-{r}"
                    sets = prepared(codes[which], workdir, overrides)
                    loads.append(round(os.getloadavg()[0], 2))
                    times[which].append(round(xbn(codes[which], workdir, "train", "-q", *sets), 1))
                    train = json.loads((workdir / "metrics" / "train.json").read_text())
                    runs[which].append({k: v for k, v in train.items() if k in RECORDED or k.startswith("probe_")})
        finally:
            for code in codes.values():
                subprocess.run(["git", "-C", str(provenance.REPO), "worktree", "remove", "--force", str(code)],
                               capture_output=True, check=False)
    ratio, verdict = judged(times)
    data: dict[str, Any] = {
        "benchmark": "xbn train wall time on the shipped glyph default: this commit / an older one",
        "old_commit": old, "new_commit": new, "overrides": ["tracking.enabled=false", *overrides],
        "rounds": args.rounds, "train_s": times, "loadavg_1min_per_run": loads, "runs": runs,
        "round_ratios": [round(n / o, 3) for n, o in zip(times["new"], times["old"])],
        "new_over_old": round(ratio, 3), "target_at_most": TARGET, "verdict": verdict,
    }
    path = write_result("train_time_quick" if args.quick else "train_time", data)
    print(f"train_time: new {times['new']} s, old {times['old']} s: new / old {ratio:.3f} "
          f"(target <= {TARGET}: {data['verdict']}) -> {path}")
    return path


def judged(times: dict[str, list[float]]) -> tuple[float, str]:
    """New / old median training time and its verdict against TARGET, from the measured times alone."""
    ratio = statistics.median(times["new"]) / statistics.median(times["old"])
    return ratio, "met" if ratio <= TARGET else "missed"


def render(data: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The report's section text and its target row; the ratio and verdict are recomputed from the measured
    times, never read from what the file says."""
    runs = data.get("runs", {})
    ratio, verdict = judged(data["train_s"])

    def accuracy(which: str) -> str:
        return ", ".join(str(r.get("best_val_recall@1")) for r in runs.get(which, [])) or "not recorded"

    text = (f"`xbn train` on the shipped glyph default (overrides: {', '.join(data['overrides'])}), "
            f"{data['rounds']} round(s) alternating which goes first: commit {data['new_commit'][:7]} took "
            f"{data['train_s']['new']} s, {data['old_commit'][:7]} took {data['train_s']['old']} s "
            f"(per-run load {data['loadavg_1min_per_run']}). New / old **{round(ratio, 3)}** (target <= "
            f"{data['target_at_most']}). Best val R@1, same seed: new {accuracy('new')}, old {accuracy('old')}. "
            f"What the new runs recorded: {json.dumps(runs.get('new', []))}.")
    row = {"section": "train_time", "what": f"make run's training wall time, new / old commit <= {TARGET}",
           "value": round(ratio, 3), "verdict": verdict}
    return text, [row]
