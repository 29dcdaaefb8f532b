"""Pipeline overhead: `dvc repro` wall time vs the summed compute of its stages, on a reduced default.

    python -m benchmarks pipeline [--quick] [--direct] [--set train.epochs=1 ...]

The repository's committed HEAD is cloned into a temporary folder (the project's own checkout is never touched)
and params.yaml there is reduced (fewer glyph classes, few epochs; `--set` adds more). The venv is the one this
interpreter runs from (its bin first on PATH, as `make run` does; nothing is installed), with the clone's `src`
first on PYTHONPATH so the stages run the cloned code.
  repro    `dvc repro`, wall time; every stage's command runs through a small shell shim named `xbn`, first on
           PATH, that records the wall and CPU time of the real `xbn` it runs, so the stages' compute is
           measured inside the same repro, under the same machine load
  no-op    `dvc repro` again with everything up to date: DVC's fixed start-up + status checks
  direct   (--direct) a second clone running each stage's `cmd` as a plain subprocess, in order, for comparison
Overhead = repro wall - sum of the stages' wall inside it, as % of that sum (and the same in CPU time).
Frozen stages are not run.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import machine_info, markdown_table, write_result

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("dvc", "torch", "mlflow", "great-expectations")
REDUCED = ["data.glyphs.classes=120", "train.epochs=1", "train.warmup_epochs=1"]
QUICK = ["data.glyphs.classes=24", "data.glyphs.images_per_class=4", "data.glyphs.image_size=32",
         "data.image_size=32", "train.epochs=1", "train.warmup_epochs=0", "train.batch_size=16",
         "eval.baseline=false", "validate.check_published_counts=false"]


def clone(dest: Path) -> str:
    subprocess.run(["git", "clone", "-q", str(REPO), str(dest)], check=True)
    return subprocess.run(["git", "-C", str(dest), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def reduce_params(repo: Path, overrides: list[str]) -> dict:
    from xbn.config import apply_overrides

    path = repo / "params.yaml"
    raw = apply_overrides(yaml.safe_load(path.read_text()), overrides)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return raw


def environment(repo: Path, shim: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    if shim is not None:
        env["PATH"] = f"{shim}:{env['PATH']}"
        env["XBN_REAL"] = str(Path(sys.executable).parent / "xbn")
        env["XBN_STAGE_LOG"] = str(shim.parent / "stages.log")
    env["PYTHONPATH"] = f"{repo / 'src'}:{repo}"
    env.update({"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "GX_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"})
    return env


def stage_commands(repo: Path) -> list[tuple[str, str]]:
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    return [(name, spec["cmd"]) for name, spec in stages.items() if not spec.get("frozen")]


SHIM = """#!/bin/bash
start=$(date +%s.%N)
"$XBN_REAL" "$@"
rc=$?
end=$(date +%s.%N)
times > "$XBN_STAGE_LOG.times"  # a builtin with a redirection runs in this shell (a pipe would fork it)
echo "$1|$start|$end|$(tail -1 "$XBN_STAGE_LOG.times")" >> "$XBN_STAGE_LOG"
exit $rc
"""


def _seconds(text: str) -> float:
    """bash `times` output '0m1.234s' -> 1.234."""
    minutes, rest = text.split("m")
    return 60 * float(minutes) + float(rest.rstrip("s"))


def install_shim(tmp: Path) -> tuple[Path, Path]:
    shim_dir, log = tmp / "shim", tmp / "stages.log"
    shim_dir.mkdir()
    (shim_dir / "xbn").write_text(SHIM)
    (shim_dir / "xbn").chmod(0o755)
    return shim_dir, log


def read_stage_log(log: Path) -> list[dict[str, Any]]:
    stages = []
    for line in log.read_text().splitlines():
        name, start, end, cpu = line.split("|")
        user, system = cpu.split()
        stages.append({"stage": name, "seconds": round(float(end) - float(start), 2),
                       "cpu_s": round(_seconds(user) + _seconds(system), 2)})
    return stages


def timed(cmd: str | list[str], repo: Path, log: Path, shim: Path | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and all its descendants)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log, "ab") as fh:
        subprocess.run(cmd, shell=isinstance(cmd, str), cwd=repo, env=environment(repo, shim), stdout=fh,
                       stderr=subprocess.STDOUT, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="params override key=value")
    parser.add_argument("--quick", action="store_true", help="a tiny glyph set at 32 px")
    parser.add_argument("--direct", action="store_true", help="also run the stages directly in a second clone")
    parser.add_argument("--keep", action="store_true", help="keep the temporary clones (printed)")
    parser.add_argument("--output", default="pipeline")
    args = parser.parse_args(argv)
    overrides = (QUICK if args.quick else REDUCED) + args.overrides
    output = "pipeline_quick" if args.quick and args.output == "pipeline" else args.output
    command = "python -m benchmarks pipeline " + " ".join(sys.argv[2:] if argv is None else argv)
    tmp = Path(tempfile.mkdtemp(prefix="xbn_pipeline_"))
    b, log = tmp / "repro", tmp / "log.txt"
    commit = clone(b)
    reduce_params(b, overrides)
    shim, stage_log = install_shim(tmp)
    dvc = str(Path(sys.executable).parent / "dvc")
    load_start = os.getloadavg()
    repro, repro_cpu = timed([dvc, "repro", "-q"], b, log, shim)
    stages = read_stage_log(stage_log)
    inside = sum(s["seconds"] for s in stages)
    inside_cpu = sum(s["cpu_s"] for s in stages)
    print(f"dvc repro: {repro:.1f} s wall, stages inside {inside:.1f} s", flush=True)
    noop, noop_cpu = timed([dvc, "repro", "-q"], b, log, shim)
    load_end = os.getloadavg()
    direct_stages: list[dict[str, Any]] = []
    if args.direct:
        a = tmp / "direct"
        clone(a)
        reduce_params(a, overrides)
        for name, cmd in stage_commands(a):
            seconds, cpu = timed(cmd, a, log)
            direct_stages.append({"stage": name, "cmd": cmd, "seconds": round(seconds, 2), "cpu_s": round(cpu, 2)})
            print(f"direct {name}: {seconds:.1f} s", flush=True)
    train_json = b / "metrics" / "train.json"
    train_seconds = yaml.safe_load(train_json.read_text()).get("train_seconds") if train_json.exists() else None
    overhead = repro - inside
    result = {
        "benchmark": "dvc repro wall time vs summed stage compute, reduced default",
        "command": command.strip(), "machine": machine_info(PACKAGES) | {"cloned_commit": commit},
        "settings": {"overrides": overrides, "stages": [s["stage"] for s in stages]},
        "loadavg_before": load_start, "loadavg_after": load_end,
        "stages_inside_repro": stages, "stages_total_s": round(inside, 2), "stages_total_cpu_s": round(inside_cpu, 2),
        "dvc_repro_s": round(repro, 2), "dvc_repro_cpu_s": round(repro_cpu, 2),
        "dvc_repro_noop_s": round(noop, 2), "dvc_repro_noop_cpu_s": round(noop_cpu, 2),
        "overhead_s": round(overhead, 2), "overhead_pct": round(100 * overhead / inside, 1),
        "overhead_cpu_s": round(repro_cpu - inside_cpu, 2),
        "overhead_cpu_pct": round(100 * (repro_cpu - inside_cpu) / inside_cpu, 1),
        "train_seconds_inside_repro": train_seconds,
        "direct_stages": direct_stages,
        "direct_total_s": round(sum(s["seconds"] for s in direct_stages), 2) if direct_stages else None,
    }
    write_result(output, result)
    print(render(result))
    if args.keep:
        print(f"kept {tmp}")
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return result


def render(result: dict[str, Any]) -> str:
    rows = [[s["stage"], s["seconds"], s["cpu_s"]] for s in result["stages_inside_repro"]]
    rows += [["**sum of stages (inside repro)**", result["stages_total_s"], result["stages_total_cpu_s"]],
             ["**dvc repro (whole)**", result["dvc_repro_s"], result["dvc_repro_cpu_s"]],
             ["dvc repro, nothing to do", result["dvc_repro_noop_s"], result["dvc_repro_noop_cpu_s"]]]
    if result.get("direct_total_s"):
        rows.append(["stages run directly, other clone, sequentially after", result["direct_total_s"], None])
    return markdown_table(["", "wall s", "CPU s"], rows)


if __name__ == "__main__":
    main()
