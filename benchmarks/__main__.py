"""`python -m benchmarks <name> [options]`: run one benchmark (or all), write benchmarks/results/<name>.json.

    python -m benchmarks memory   [--quick] [--sizes ...] [--batches ...] [--device cpu|cuda] [--set loss.miner=null]
    python -m benchmarks map_variants [--quick]  (issue 44: XBN's map in place vs folded into the similarity)
    python -m benchmarks eval     [--quick] [--sizes ...]
    python -m benchmarks loader   [--quick]
    python -m benchmarks pipeline [--quick]
    python -m benchmarks grid     [--quick] [--datasets ...] [--batches ...] [--seeds ...] [--workers N]
    python -m benchmarks grid --regime roth|memvir [--quick]   (a seed method in its paper's regime)
    python -m benchmarks gpu      [--quick]            (CUDA only: records 'not run' otherwise)
    python -m benchmarks serving  [--quick] [--only search ivf_pq onnx]  (issue 17: /search, IVF-PQ, ONNX)
    python -m benchmarks methods  [--only ...] [--set ...]  (every method via dvc exp run; about 2 hours)
    python -m benchmarks retrain  [--quick] [--only fingerprint warm_start]  (issue 24: snapshot, warm start)
    python -m benchmarks train_time [--old COMMIT] [--quick]  (issue 28: xbn train, an older commit vs this one)
    python -m benchmarks bigindex [--quick] [--n ROWS]  (issue 29: a 10M on-disk IVF-PQ served; ~30 GB in /tmp)
    python -m benchmarks catalogue [--quick] [--images N] [--rounds R]  (issue 29: Dask workers vs xbn embed)
    python -m benchmarks all      [--quick] [--since UTC]  (each of the above with its defaults, then the report)
    python -m benchmarks report                         (docs/benchmarks.md from the JSON files)

Every result records its provenance (benchmarks/provenance.py: commit, load before and after, UTC dates, the
command, the machine). A benchmark refuses to run on a tree that differs from its commit unless `--allow-dirty`
(anywhere on the line), which marks the result `dirty: true`.

Each writes its JSON atomically (`xbn.utils.io.write_json`); `report` renders docs/benchmarks.md from whatever
results exist, so a benchmark that was not re-run keeps its previous numbers (with their own date and command).
Options after the name go to that benchmark; `--help` after a name lists them.

`all --since 2026-11-27T03:20` skips each benchmark whose results file is clean and started at or after that
UTC time: a serial run of everything (longer than a 3-hour session on a 2-core AVX2 machine) that a stopped
session left half done goes on where it stopped, each file keeping its own commit, load and CPU flags. Before
each benchmark `all` waits (at most 10 minutes) for the 1-minute load to fall under 1.0.
"""

from __future__ import annotations

import datetime
import sys
import traceback

from benchmarks import provenance

# The speed benchmarks first, the long accuracy runs (grid about 1 hour, methods 1 to 3) last: a run stopped
# part way (`all --since` goes on from there) has the speed verdicts.
NAMES = ("memory", "eval", "loader", "pipeline", "gpu", "serving", "train_time", "catalogue", "retrain", "bigindex",
         "grid", "methods")


def measured_since(name: str, since: datetime.datetime) -> bool:
    """Whether `name`'s default results file is clean and started at or after `since`."""
    from benchmarks.common import read_result

    stem = {"memory": "memory_cuda" if _has_cuda() else "memory_cpu"}.get(name, name)
    try:
        record = (read_result(stem) or {})["provenance"]
        started = _utc(record["started_utc"])
    except (ValueError, KeyError, TypeError):
        return False
    return not record.get("dirty") and started >= since


def _utc(text: str) -> datetime.datetime:
    when = datetime.datetime.fromisoformat(text)
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(name: str, argv: list[str], allow_dirty: bool = False) -> None:
    if name != "report":  # the start's commit, load and time; refused here, before any time is spent
        provenance.begin(["python", "-m", "benchmarks", name, *argv, *(["--allow-dirty"] if allow_dirty else [])],
                         allow_dirty=allow_dirty)
    if name == "memory":
        from benchmarks import memory_bench

        memory_bench.main(argv)
    elif name == "map_variants":
        from benchmarks import map_variants

        map_variants.main(argv)
    elif name == "eval":
        from benchmarks import eval_bench

        if "--quick" in argv:
            argv = [a for a in argv if a != "--quick"] + ["--sizes", "2000", "5000", "--output", "eval_quick"]
        eval_bench.main(argv)
    elif name == "loader":
        from benchmarks import loader_bench

        loader_bench.main(argv)
    elif name == "pipeline":
        from benchmarks import pipeline_bench

        pipeline_bench.main(argv)
    elif name == "methods":
        from benchmarks import methods

        if "--quick" in argv:
            from benchmarks.pipeline_bench import QUICK

            argv = [a for a in argv if a != "--quick"] + [f"--set={o}" for o in QUICK] + ["--output",
                                                                                        "methods_quick"]
        methods.main(argv)
    elif name == "gpu":
        from benchmarks import gpu_bench

        gpu_bench.main(argv)
    elif name == "serving":
        from benchmarks import serving_bench

        serving_bench.main(argv)
    elif name == "grid":
        from benchmarks import grid

        grid.main(argv)
    elif name == "retrain":
        from benchmarks import retrain_bench

        retrain_bench.main(argv)
    elif name == "train_time":
        from benchmarks import train_time

        train_time.main(argv)
    elif name == "bigindex":
        from benchmarks import bigindex_bench

        bigindex_bench.main(argv)
    elif name == "catalogue":
        from benchmarks import catalogue_bench

        catalogue_bench.main(argv)
    elif name == "report":
        from benchmarks import report

        report.main(argv)
    else:
        raise SystemExit(f"unknown benchmark {name!r}; choose from {', '.join((*NAMES, 'all', 'report'))}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    name, rest = argv[0], [a for a in argv[1:] if a != "--allow-dirty"]
    allow_dirty = "--allow-dirty" in argv
    if name != "all":
        try:
            run(name, rest, allow_dirty)
        except provenance.DirtyTreeError as err:
            print(f"benchmarks {name}: {err}", file=sys.stderr)
            return 2
        return 0
    quick = ["--quick"] if "--quick" in rest else []
    since = None
    if "--since" in rest:
        at = rest.index("--since")
        try:
            since = _utc(rest[at + 1])
        except (IndexError, ValueError):
            print("benchmarks all: --since needs a UTC time such as 2026-11-27T03:20", file=sys.stderr)
            return 2
    failed = []
    for each in NAMES:
        if since is not None and measured_since(each, since):
            print(f"== {each}: measured since {since.isoformat()}, skipped", flush=True)
            continue
        load, waited = provenance.settle()
        print(f"== {each} (1-minute load {load}" + (f", after {waited:.0f} s waiting for it to settle)" if waited
                                                     else ")"), flush=True)
        try:
            run(each, list(quick), allow_dirty)
        except provenance.DirtyTreeError as err:
            print(f"benchmarks all: {err}", file=sys.stderr)
            return 2
        except Exception:  # noqa: BLE001 - one benchmark failing must not stop the others
            traceback.print_exc()
            failed.append(each)
    run("report", [])  # prints each target: met, missed or inconclusive
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
