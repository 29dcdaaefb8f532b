"""Named fault points: the places where the fault tests (issue 40) kill, terminate or break a run on purpose,
instead of sleeping and hoping a signal lands at the right line.

`fault_point("retrain.start")` does nothing unless the environment variable `XBN_FAULT` names that point, as
`<point>` or `<point>:<action>`:
- `kill` (the default): SIGKILL this process, as a drained node or an OOM killer would (no handler runs);
- `term`: SIGTERM, as `docker stop` or a worker shutting down would (Prefect marks the run CRASHED);
- `raise`: raise `FaultInjected`, an ordinary failure at that line;
- `wait`: pause there until a test has done its fault (restarted a server, cut a connection): the process
  writes `<XBN_FAULT_DIR>/<point>.reached`, then waits for `<point>.release` in that folder (at most
  `WAIT_LIMIT_S`, then `FaultInjected`). Once released, the point lets every later pass through.
Several points: separate them with commas. A point is named `<module or flow>.<moment>`.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

FAULT_ENV = "XBN_FAULT"
FAULT_DIR_ENV = "XBN_FAULT_DIR"  # where `wait` says it arrived and looks for its release
WAIT_LIMIT_S = 900.0


class FaultInjected(RuntimeError):
    """The failure a `raise` fault point injects (the message names the point)."""


def fault_point(name: str) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    for entry in spec.split(","):
        point, _, action = entry.strip().partition(":")
        if point != name:
            continue
        action = action or "kill"
        log.warning("fault point %s: %s (%s=%s)", name, action, FAULT_ENV, spec)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif action == "raise":
            raise FaultInjected(f"fault injected at {name}")
        elif action == "wait":
            _wait(name)
        else:
            raise ValueError(f"{FAULT_ENV}: unknown action {action!r} for {name} (kill, term, raise or wait)")


def _wait(name: str) -> None:
    folder = Path(os.environ.get(FAULT_DIR_ENV) or ".")
    release = folder / f"{name}.release"
    if release.exists():
        return
    (folder / f"{name}.reached").touch()
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not release.exists():
        if time.monotonic() > deadline:
            raise FaultInjected(f"fault point {name}: not released within {WAIT_LIMIT_S:g} s ({release})")
        time.sleep(0.2)


__all__ = ["FAULT_DIR_ENV", "FAULT_ENV", "FaultInjected", "fault_point"]
