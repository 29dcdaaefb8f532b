"""DVC's own files, checked before xbn opens the project: a process killed while DVC rewrote one in place (DVC
writes them without a temp file) leaves it truncated, and every later snapshot then failed the same way, each
week retried as if transient (issue 40).

- `<data.root>.dvc`, the data folder's record: the snapshot rebuilds it from the folder itself (`dvc add`), so
  a record that does not parse is moved aside (`.corrupt-<time>`, nothing deleted) and rebuilt.
- `dvc.lock`: moved aside the same way; `dvc repro` then re-runs the stages it no longer knows were done.
- `.dvc/tmp/rwlock`: a file that is not DVC's JSON is reset; an entry whose PID is alive but runs another
  command than the one recorded (the PID was reused after a kill) is dropped. DVC itself drops only the
  entries of dead PIDs, and waits forever on a reused one. Edited under DVC's own `rwlock.lock`.
Written by hand: DVC offers no repair of its own files.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import yaml

from xbn.utils.io import write_text

log = logging.getLogger(__name__)


def repair_dvc_files(project: str | Path, data_root: str | Path | None = None) -> list[str]:
    """Repair what a kill can leave behind in the DVC project at `project` (see the module docstring); returns
    one line per repair, each also logged as a warning."""
    project = Path(project)
    done = []
    if data_root is not None:
        root = Path(data_root).absolute()
        record = root.parent / f"{root.name}.dvc"
        done += _aside_if(record, _is_dvc_record, "rebuilt from the folder by this snapshot")
    done += _aside_if(project / "dvc.lock", _is_lock_file, "the next `dvc repro` re-runs its stages")
    done += _repair_rwlock(project / ".dvc" / "tmp")
    for line in done:
        log.warning("DVC: %s", line)
    return done


def _aside_if(path: Path, valid, consequence: str) -> list[str]:
    if not path.is_file():
        return []
    try:
        if valid(yaml.safe_load(path.read_text())):
            return []
    except (yaml.YAMLError, UnicodeDecodeError):
        pass
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
    path.rename(aside)
    return [f"{path} did not parse (a write cut short?): moved to {aside.name}; {consequence}"]


def _is_dvc_record(data: Any) -> bool:
    outs = data.get("outs") if isinstance(data, dict) else None
    return isinstance(outs, list) and bool(outs) and all(
        isinstance(o, dict) and isinstance(o.get("path"), str) and (o.get("md5") or o.get("hash")) for o in outs)


def _is_lock_file(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("stages", {}), dict) and all(
        isinstance(stage, dict) for stage in data.get("stages", {}).values())


def _repair_rwlock(tmp_dir: Path) -> list[str]:
    path = tmp_dir / "rwlock"
    if not path.is_file():
        return []
    from dvc.lock import make_lock

    with make_lock(str(tmp_dir / "rwlock.lock"), tmp_dir=str(tmp_dir)):
        try:
            lock = json.loads(path.read_text())
            if not isinstance(lock, dict):
                raise ValueError("not an object")
        except ValueError:
            write_text(path, json.dumps({"read": {}, "write": {}}))
            return [f"{path} was not DVC's JSON (a write cut short?): reset to no locks held"]
        dropped = []
        for mode in ("read", "write"):
            held = lock.get(mode) or {}
            for target in list(held):
                infos = held[target] if isinstance(held[target], list) else [held[target]]
                kept = [i for i in infos if not _reused_pid(i)]
                dropped += [f"{mode} lock on {target} by PID {i.get('pid')} ({i.get('cmd')!r})" for i in infos
                            if i not in kept]
                if not kept:
                    del held[target]
                elif mode == "read":
                    held[target] = kept
        if not dropped:
            return []
        write_text(path, json.dumps(lock))
    return [f"{path}: dropped {', '.join(dropped)}: that PID now runs another command (its holder was killed)"]


def _reused_pid(info: Any) -> bool:
    """A lock entry whose PID is alive but provably runs another program than the one that took the lock."""
    import psutil

    try:
        process = psutil.Process(int(info["pid"]))
        return not _may_have_recorded(process.cmdline(), info["cmd"])
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False  # dead: DVC drops it itself, with its own warning
    except (psutil.AccessDenied, KeyError, TypeError, ValueError):
        return False  # cannot tell: leave it to DVC


def _may_have_recorded(cmdline: list[str], recorded: str) -> bool:
    """Whether a process whose argv the OS shows as `cmdline` can be the one that wrote `recorded`: DVC records
    `" ".join(sys.argv)`, which for a Python program leaves out the interpreter and its options (`python
    /venv/bin/dvc repro` records "/venv/bin/dvc repro"), and for `python -m dvc` starts with the module's
    __main__.py. Unknown (no argv: a kernel thread, no access): True, so the lock is left alone."""
    if not cmdline:
        return True
    if recorded in {" ".join(cmdline[i:]) for i in range(len(cmdline))}:
        return True
    program, _, arguments = recorded.partition(" ")
    if "-m" in cmdline and Path(program).name == "__main__.py":
        module_at = cmdline.index("-m") + 1
        return " ".join(cmdline[module_at + 1:]) == arguments
    return False
