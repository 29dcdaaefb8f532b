"""What every flow's tasks share: their retry rule and options (`@task(**TASK_OPTIONS)`), in a module of their
own so that a flow calling another (retrain -> catalogue) imports it without an import circle."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict

from prefect.cache_policies import NO_CACHE, CachePolicy

from xbn.stages.loop import transient


def retry_transient(task, task_run_, state) -> bool:
    """Retry unless the failure is the data's, the config's or a model file's own fault (`transient`)."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - anything else may be transient (I/O, a service, a killed worker)
        return transient(exc)
    return False


class TaskDefaults(TypedDict):
    """Every task's options, typed so that `@task(**TASK_OPTIONS)` matches the decorator's overloads (a plain
    dict's values are `object` to a type checker)."""

    retries: int
    retry_delay_seconds: int
    retry_condition_fn: Callable[..., bool]
    cache_policy: CachePolicy


TASK_OPTIONS = TaskDefaults(retries=2, retry_delay_seconds=10, retry_condition_fn=retry_transient,
                            cache_policy=NO_CACHE)
