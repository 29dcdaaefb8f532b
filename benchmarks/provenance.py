"""Where a result came from, recorded by every benchmark the same way (`write_result` adds it to each file).

    run = begin(sys.argv, allow_dirty=False)   # at the start: refuses a dirty tree, notes load and time
    ...                                         # the benchmark
    finish()                                    # at the end: load after, end time (write_result calls it)

A result says which commit it measured only if the tracked files equal that commit, so a dirty tree is refused
(`DirtyTreeError`) unless `--allow-dirty`, which marks the result `dirty: true` and lists the files that
differed. The benchmarks' own outputs (benchmarks/results/, docs/) do not count: one benchmark of
`python -m benchmarks all` writing its JSON must not make the next one refuse. Dates are UTC ISO strings taken
here, so a report never reads file modification times (a copy or checkout changes those).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUTPUTS = ("benchmarks/results/", "docs/")  # what the benchmarks write: not part of the code they measure
# CPU features that decide which GEMM kernels exist (float32 FMA vs AVX-512, bf16/int8 dot products, AMX).
FLAG_PREFIXES = ("avx", "fma", "amx", "f16c")
PACKAGES = ("torch", "faiss-cpu", "numpy", "pytorch-metric-learning")


class DirtyTreeError(RuntimeError):
    """The working tree differs from its commit: a result from it would name a commit it did not measure."""


@dataclass
class Run:
    argv: list[str]
    commit: str | None
    dirty: bool
    dirty_paths: list[str]
    started_utc: str
    loadavg_1min_before: float
    machine: dict[str, Any] = field(default_factory=dict)

    def finish(self) -> dict[str, Any]:
        """The provenance record, with the load and the time now as the run's end."""
        return {
            "git_commit": self.commit, "dirty": self.dirty, "dirty_paths": self.dirty_paths,
            # `command` reruns this benchmark alone; `argv` is the process's exact command line (`all` runs
            # several benchmarks under one)
            "command": " ".join(self.argv), "argv": list(sys.argv),
            "started_utc": self.started_utc, "finished_utc": utc_now(),
            "loadavg_1min_before": self.loadavg_1min_before, "loadavg_1min_after": round(os.getloadavg()[0], 2),
            "machine": self.machine,
        }


_current: Run | None = None


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {out.stderr.strip()}")
    return out.stdout


def copied_from(repo: Path = REPO) -> str | None:
    """The commit a tree without its .git was copied from (the device tool sends the working tree only, so a
    GPU run names the commit it was sent from in XBN_BENCH_COMMIT); None where the tree has its .git."""
    return os.environ.get("XBN_BENCH_COMMIT") if not (repo / ".git").exists() else None


def head(repo: Path = REPO) -> str:
    return copied_from(repo) or git(repo, "rev-parse", "HEAD").strip()


def dirty_paths(repo: Path = REPO) -> list[str]:
    """Tracked files that differ from HEAD (staged or not), outside the benchmarks' outputs; none for a copied
    tree (`copied_from`: the sender's own check refused a dirty one)."""
    if copied_from(repo):
        return []
    lines = git(repo, "status", "--porcelain", "--untracked-files=no").splitlines()
    paths = [line[3:].split(" -> ")[-1] for line in lines if line.strip()]
    return [p for p in paths if not p.startswith(OUTPUTS)]


def in_history(commit: str, repo: Path = REPO) -> bool:
    """Whether `commit` is an ancestor of HEAD (a result citing a commit outside it cannot be reproduced)."""
    out = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", commit, "HEAD"],
                         capture_output=True, timeout=30, check=False)
    return out.returncode == 0


def cpu_info() -> dict[str, Any]:
    """CPU model, logical cores, and the instruction-set flags that matter for GEMM throughput."""
    model, flags = platform.processor(), []
    try:
        with open("/proc/cpuinfo") as fh:
            lines = fh.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = value.split()
            break
    relevant = sorted(f for f in flags if f.startswith(FLAG_PREFIXES))
    return {"cpu": model, "cores": os.cpu_count(), "cpu_flags": relevant,
            "avx512": any(f.startswith("avx512") for f in flags)}


def machine(packages: tuple[str, ...] = PACKAGES) -> dict[str, Any]:
    info = cpu_info() | {"python": platform.python_version(), "os": platform.platform()}
    info["packages"] = {}
    for name in packages:
        try:
            info["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info["packages"][name] = None
    try:  # torch's own view: the SIMD level its CPU kernels dispatch to
        import torch

        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        info["torch_cpu_capability"] = None
    return info


def begin(argv: list[str] | None = None, *, allow_dirty: bool = False, repo: Path = REPO) -> Run:
    """Start recording a run (and make it the current one); `argv` is the command that reruns it. Raises DirtyTreeError on a dirty tree unless
    `allow_dirty`."""
    global _current
    paths = dirty_paths(repo)
    if paths and not allow_dirty:
        shown = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
        raise DirtyTreeError(
            f"the working tree differs from its commit ({shown}): a result would name a commit it did not "
            "measure. Commit first, or pass --allow-dirty to record it as dirty: true")
    _current = Run(argv=list(sys.argv if argv is None else argv), commit=head(repo),
                   dirty=bool(paths), dirty_paths=paths, started_utc=utc_now(),
                   loadavg_1min_before=round(os.getloadavg()[0], 2), machine=machine())
    return _current


def settle(below: float = 1.0, at_most_s: float = 600.0, poll_s: float = 10.0, *, load=None, sleep=time.sleep
           ) -> tuple[float, float]:
    """Wait until the 1-minute load average is under `below`, for at most `at_most_s`; returns (the load then,
    seconds waited). The previous benchmark's own work decays from that average with a 1-minute time
    constant, so `all` waits here before each benchmark rather than start it on a tail of its predecessor
    (seen: loads of 2.0-2.3 at the start of eval, train_time and catalogue)."""
    load = load or (lambda: os.getloadavg()[0])
    waited = 0.0
    while (now := load()) >= below and waited < at_most_s:
        sleep(poll_s)
        waited += poll_s
    return round(now, 2), waited


def current() -> Run | None:
    return _current


def finish() -> dict[str, Any]:
    """The current run's record; RuntimeError if none began (the start's load and time would be unknown)."""
    if _current is None:
        raise RuntimeError("no benchmark run has begun: run benchmarks as `python -m benchmarks <name>`, which "
                           "records the commit, the load and the time at the start")
    return _current.finish()
