"""`python -m benchmarks <name> [options]`: run one benchmark (or all), write benchmarks/results/<name>.json.

    python -m benchmarks memory   [--quick] [--sizes ...] [--batches ...] [--device cpu|cuda]
    python -m benchmarks eval     [--quick] [--sizes ...]
    python -m benchmarks loader   [--quick]
    python -m benchmarks pipeline [--quick]
    python -m benchmarks grid     [--quick] [--datasets ...] [--batches ...] [--seeds ...] [--workers N]
    python -m benchmarks grid --regime roth|memvir [--quick]   (a seed method in its paper's regime)
    python -m benchmarks gpu      [--quick]            (CUDA only: records 'not run' otherwise)
    python -m benchmarks methods  [--only ...] [--set ...]  (every method via dvc exp run; about 2 hours)
    python -m benchmarks all      [--quick]            (each of the above with its defaults, then the report)
    python -m benchmarks report                         (docs/benchmarks.md from the JSON files)

Each writes its JSON atomically (`xbn.utils.io.write_json`); `report` renders docs/benchmarks.md from whatever
results exist, so a benchmark that was not re-run keeps its previous numbers (with their own date and command).
Options after the name go to that benchmark; `--help` after a name lists them.
"""

from __future__ import annotations

import sys
import traceback

NAMES = ("memory", "eval", "loader", "pipeline", "grid", "gpu", "methods")


def run(name: str, argv: list[str]) -> None:
    if name == "memory":
        from benchmarks import memory_bench

        memory_bench.main(argv)
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
    elif name == "grid":
        from benchmarks import grid

        grid.main(argv)
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
    name, rest = argv[0], argv[1:]
    if name != "all":
        run(name, rest)
        return 0
    quick = ["--quick"] if "--quick" in rest else []
    failed = []
    for each in NAMES:
        print(f"== {each}", flush=True)
        try:
            run(each, list(quick))
        except Exception:  # noqa: BLE001 - one benchmark failing must not stop the others
            traceback.print_exc()
            failed.append(each)
    run("report", [])
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
