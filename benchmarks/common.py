"""Helpers shared by the benchmarks: machine and version info, results files, and guarded child processes.

Each contender runs in its own child process so that its peak RSS is its own (read from `wait4`'s rusage,
not sampled), and so that a contender running out of memory is recorded instead of taking the machine down.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks import provenance
from xbn.utils.io import write_json

RESULTS_DIR = Path(__file__).resolve().parent / "results"
GB = 2**30
# torch + faiss map ~4 GB of address space at import (VmSize 4.0 GB for 0.9 GB RSS, measured): RLIMIT_AS gets
# this much on top of the memory limit, and a watchdog enforces the limit itself on the RSS.
ADDRESS_SPACE_HEADROOM_GB = 4.0
# What an allocation failure under RLIMIT_AS prints in Python, torch, and C++ (faiss).
_OOM_MARKERS = ("MemoryError", "can't allocate memory", "Cannot allocate memory", "std::bad_alloc")


def machine_info(packages: tuple[str, ...] = ()) -> dict[str, Any]:
    """CPU, core count, RAM, OS, Python and package versions, and the git commit, for a results file (the
    run's provenance, with the load and dates, is added by `write_result`)."""
    info = provenance.cpu_info()
    try:
        commit, dirty = provenance.head(provenance.REPO), bool(provenance.dirty_paths())
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        commit, dirty = None, None
    return {
        "cpu": info["cpu"],
        "cpus": info["cores"],
        "ram_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "packages": {name: _version(name) for name in packages},
        "git_commit": commit,
        "git_dirty": dirty,  # tracked files differed from the commit: the numbers are not its own
    }


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def write_result(name: str, data: dict[str, Any]) -> Path:
    """Write `benchmarks/results/<name>.json` atomically, with the current run's provenance, and return its
    path."""
    path = RESULTS_DIR / f"{name}.json"
    write_json(path, data | {"provenance": provenance.finish()})
    return path


def read_result(name: str) -> dict[str, Any] | None:
    """`benchmarks/results/<name>.json` as written by `write_result`, or None if it is missing or unreadable."""
    try:
        return json.loads((RESULTS_DIR / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def current_rss_gb() -> float:
    """This process's resident set size now (Linux), in GiB."""
    return _rss_bytes(os.getpid()) / GB


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class ChildRun:
    """How a guarded child process ended."""

    returncode: int
    peak_rss_gb: float
    wall_s: float
    out_of_memory: bool
    timed_out: bool
    log_tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not (self.out_of_memory or self.timed_out)


def run_child(argv: list[str], *, mem_limit_gb: float, timeout_s: float, log_path: Path) -> ChildRun:
    """Run `argv` with its memory capped at `mem_limit_gb` of RSS, and report its peak RSS.

    Two guards: RLIMIT_AS in the child (allocations beyond the limit plus the address-space headroom fail
    inside the child, which then exits with a MemoryError), and a watchdog that kills the child as soon as its
    RSS passes the limit (so a process that maps more than it touches is still held to the limit).
    """
    address_space = int((mem_limit_gb + ADDRESS_SPACE_HEADROOM_GB) * GB)

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    started = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit_memory)
    killed_for: list[str] = []
    done = threading.Event()

    def watchdog() -> None:
        while not done.wait(0.1):
            if _rss_bytes(proc.pid) > mem_limit_gb * GB:
                killed_for.append("memory")
            elif time.perf_counter() - started > timeout_s:
                killed_for.append("time")
            else:
                continue
            os.kill(proc.pid, signal.SIGKILL)
            return

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    thread.join()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
    wall = time.perf_counter() - started
    tail = log_path.read_text(errors="replace")[-3000:]
    oom = "memory" in killed_for or (proc.returncode != 0 and any(m in tail for m in _OOM_MARKERS))
    return ChildRun(
        returncode=proc.returncode,
        peak_rss_gb=usage.ru_maxrss * 1024 / GB,  # ru_maxrss is in KiB on Linux
        wall_s=wall,
        out_of_memory=oom,
        timed_out="time" in killed_for,
        log_tail=tail,
    )


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub markdown table; floats printed with 4 significant digits."""

    def cell(value: Any) -> str:
        if value is None:
            return "—"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value).replace("|", "\\|")  # a pipe inside a cell would end it

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def python_module_argv(module: str, *args: str) -> list[str]:
    """argv that runs `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]
