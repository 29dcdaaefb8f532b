"""The loop's order, written once for its three drivers: the Prefect retrain flow (xbn/flows/retrain.py, each
step a task with retries), `xbn retrain` (that flow, run now) and `xbn run` (the same steps in-process).

    prepare -> snapshot -> repair -> plan -> validate -> [tune] -> train -> refine -> evaluate -> register -> index

`repair` comes before the plan's "nothing changed": a registration a killed run left unfinished is completed
(a promotion waiting for its index is indexed from its own registered checkpoint first, which completes it), and
a champion whose index is missing or altered is indexed again, all without training. A repair never stops the
week: one that still fails after its retries (none for the version's own fault: a checkpoint failing its sha256,
a bad param) abandons that registration, or leaves the champion's index as it is, says so, and the run goes on
to its plan. Only what is no version's fault (the store or the lock gone) stops the run, as it would any stage.
A registration's own states (created -> awaiting_index -> done | abandoned) live in xbn.stages.register; this
module orders the stages.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xbn.config import ConfigError, Params
from xbn.data import DatasetError
from xbn.stages.index import champion_index_problem, index_version
from xbn.utils.errors import IntegrityError, NonFiniteLossError, ServiceUnavailableError
from xbn.utils.locks import LockLost
from xbn.utils.secrets import mask_error

log = logging.getLogger(__name__)

# The stages a run executes after its plan, in order (`xbn run`'s chain and the flow's tasks; dvc.yaml's stages
# are the same commands).
ORDER = ("prepare", "validate", "train", "refine", "evaluate", "register", "index")


REPAIR_TRIES = 3  # in-process; the flow's tasks retry as every task does (TASK_OPTIONS)
# Not the version's fault: the run stops, as any stage would.
_STOPS_THE_RUN = (ServiceUnavailableError, LockLost)


def transient(exc: BaseException) -> bool:
    """Worth another try: not the data's, the config's or the model file's own fault (the one rule of the flow's
    task retries and of the in-process repair)."""
    return not isinstance(exc, (DatasetError, ConfigError, ValueError, NonFiniteLossError, ServiceUnavailableError,
                                IntegrityError, LockLost))


def _retried(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def call(*args):
        for attempt in range(1, REPAIR_TRIES + 1):
            try:
                return step(*args)
            except Exception as exc:
                if attempt == REPAIR_TRIES or not transient(exc):
                    raise
                log.warning("repair: %s failed (%s), try %d of %d", step.__name__, exc, attempt + 1, REPAIR_TRIES)
                time.sleep(2.0 * attempt)
    return call


def _finish_move(params: Params) -> dict | None:
    from xbn.stages.register import finish_champion_move

    return finish_champion_move(params)


def _interrupted(params: Params) -> list[int]:
    from xbn.stages.register import interrupted_versions

    return interrupted_versions(params)


@_retried
def _complete(params: Params, version: int) -> dict:
    from xbn.stages.register import complete_version

    return complete_version(params, version)


def _abandon(params: Params, version: int, reason: str) -> dict:
    from xbn.stages.register import abandon

    return abandon(params, version, reason, by_gate=True)


def _registration(params: Params, version: int) -> dict:
    from xbn.stages.register import registration

    return registration(params, version)


def _check_index(params: Params) -> dict | None:
    return champion_index_problem(params)


@_retried
def _attach_index(params: Params, version: int) -> Any:
    return index_version(params, version)


@dataclass(frozen=True)
class RepairSteps:
    """How each repair step runs: in-process by default; the flow passes its Prefect tasks (retried), and an
    index over the whole catalogue where the champion serves one."""

    finish_move: Callable[[Params], dict | None] = _finish_move
    interrupted: Callable[[Params], list[int]] = _interrupted
    complete: Callable[[Params, int], dict] = _complete
    registration: Callable[[Params, int], dict] = _registration
    check_index: Callable[[Params], dict | None] = _check_index
    attach_index: Callable[[Params, int], Any] = _attach_index
    abandon: Callable[[Params, int, str], dict] = _abandon


@dataclass(frozen=True)
class Repaired:
    title: str  # the notification's title
    line: str  # what was repaired, for the log and the notification


def repair(params: Params, steps: RepairSteps = RepairSteps()) -> list[Repaired]:
    """What a killed or failed run left behind, repaired before the plan, without training (the registry must
    be on); one `Repaired` per repair, for the caller to log and notify (in its own words: a flow run's link)."""
    from xbn.stages.register import AWAITING_INDEX

    repaired = []
    name = params.registry.model_name
    if moved := steps.finish_move(params):  # logged, alias not moved: the log is what was decided
        repaired.append(Repaired(
            f"xbn: champion v{moved['to_version']} restored from its history",
            f"the {moved['action']} #{moved['seq']} of {name} (v{moved['from_version']} -> v{moved['to_version']}) "
            "was logged but its alias never moved (a process killed between the two): moved now"))
    for version in steps.interrupted(params):
        try:
            done = steps.complete(params, version)
            if done["registration"] == AWAITING_INDEX:  # promoted by the gate, killed before its index
                steps.attach_index(params, version)  # completes the promotion
                done = steps.registration(params, version)
        except _STOPS_THE_RUN:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever it is, this version must not stop every later week
            why = mask_error(exc)
            steps.abandon(params, version, f"its interrupted registration could not be completed: {why}")
            repaired.append(Repaired(
                f"xbn: v{version} registration abandoned",
                f"the interrupted registration of {name} v{version} could not be completed ({why}): abandoned "
                "(held, never champion); the champion is unchanged and this run goes on"))
            continue
        repaired.append(Repaired(
            f"xbn: v{done['version']} registration completed",
            f"completed the interrupted registration of {done['model_name']} v{done['version']} "
            f"({done['decision']}: {done['reason']}; champion v{done['champion_version']})"))
    broken = None
    try:
        if broken := steps.check_index(params):
            steps.attach_index(params, broken["version"])
            repaired.append(Repaired(
                f"xbn: champion v{broken['version']} index repaired",
                f"champion v{broken['version']} {broken['problem']}: indexed again from its own checkpoint"))
    except _STOPS_THE_RUN:
        raise
    except Exception as exc:  # noqa: BLE001 - the champion keeps what it has; the week still trains
        which = f"v{broken['version']}" if broken else "the champion"
        repaired.append(Repaired(
            f"xbn: champion {which} index not repaired",
            f"{name} champion {which}'s index could not be checked or rebuilt ({mask_error(exc)}): it may not serve a "
            f"search until one is attached (`xbn index --model-version V`); this run goes on"))
    return repaired


__all__ = ["ORDER", "RepairSteps", "Repaired", "repair", "transient"]
