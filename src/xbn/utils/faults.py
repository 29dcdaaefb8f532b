"""Named fault points: the places where the fault tests (issue 40) kill, terminate or break a run on purpose,
instead of sleeping and hoping a signal lands at the right line.

`fault_point("retrain.start")` does nothing unless the environment variable `XBN_FAULT` names that point, as
`<point>` or `<point>:<action>`:
- `kill` (the default): SIGKILL this process, as a drained node or an OOM killer would (no handler runs);
- `term`: SIGTERM, as `docker stop` or a worker shutting down would (Prefect marks the run CRASHED);
- `raise`: raise `FaultInjected`, an ordinary failure at that line.
Several points: separate them with commas. A point is named `<module or flow>.<moment>`.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

FAULT_ENV = "XBN_FAULT"


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
        else:
            raise ValueError(f"{FAULT_ENV}: unknown action {action!r} for {name} (kill, term or raise)")


__all__ = ["FAULT_ENV", "FaultInjected", "fault_point"]
