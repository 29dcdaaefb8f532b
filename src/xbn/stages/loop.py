"""The loop's order, written once for its three drivers: the Prefect retrain flow (xbn/flows/retrain.py, each
step a task with retries), `xbn retrain` (that flow, run now) and `xbn run` (the same steps in-process).

    prepare -> snapshot -> repair -> plan -> validate -> [tune] -> train -> refine -> evaluate -> register -> index

`repair` comes before the plan's "nothing changed": a registration a killed run left unfinished is completed
(a promotion waiting for its index is indexed from its own registered checkpoint first, which completes it), and
a champion whose index is missing or altered is indexed again, all without training. A registration's own
states (created -> awaiting_index -> done) live in xbn.stages.register; this module orders the stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xbn.config import Params

# The stages a run executes after its plan, in order (`xbn run`'s chain and the flow's tasks; dvc.yaml's stages
# are the same commands).
ORDER = ("prepare", "validate", "train", "refine", "evaluate", "register", "index")


def _complete(params: Params) -> list[dict]:
    from xbn.stages.register import complete_interrupted

    return complete_interrupted(params)


def _registration(params: Params, version: int) -> dict:
    from xbn.stages.register import registration

    return registration(params, version)


def _check_index(params: Params) -> dict | None:
    from xbn.stages.index import champion_index_problem

    return champion_index_problem(params)


def _attach_index(params: Params, version: int) -> Any:
    from xbn.stages.index import index_version

    return index_version(params, version)


@dataclass(frozen=True)
class RepairSteps:
    """How each repair step runs: in-process by default; the flow passes its Prefect tasks (retried), and an
    index over the whole catalogue where the champion serves one."""

    complete: Callable[[Params], list[dict]] = _complete
    registration: Callable[[Params, int], dict] = _registration
    check_index: Callable[[Params], dict | None] = _check_index
    attach_index: Callable[[Params, int], Any] = _attach_index


@dataclass(frozen=True)
class Repaired:
    title: str  # the notification's title
    line: str  # what was repaired, for the log and the notification


def repair(params: Params, steps: RepairSteps = RepairSteps()) -> list[Repaired]:
    """What a killed or failed run left behind, repaired before the plan, without training (the registry must
    be on); one `Repaired` per repair, for the caller to log and notify (in its own words: a flow run's link)."""
    from xbn.stages.register import AWAITING_INDEX

    repaired = []
    for done in steps.complete(params):
        if done["registration"] == AWAITING_INDEX:  # promoted by the gate, killed before its index
            steps.attach_index(params, done["version"])  # completes the promotion
            done = steps.registration(params, done["version"])
        repaired.append(Repaired(
            f"xbn: v{done['version']} registration completed",
            f"completed the interrupted registration of {done['model_name']} v{done['version']} "
            f"({done['decision']}: {done['reason']}; champion v{done['champion_version']})"))
    if broken := steps.check_index(params):
        steps.attach_index(params, broken["version"])
        repaired.append(Repaired(
            f"xbn: champion v{broken['version']} index repaired",
            f"champion v{broken['version']} {broken['problem']}: indexed again from its own checkpoint"))
    return repaired


__all__ = ["ORDER", "RepairSteps", "Repaired", "repair"]
